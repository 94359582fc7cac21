"""DeepSeek's day 6 simulated hour by hour: the published demand curve on the published node
curve (`sim.diurnal`), each hour's per-node load run through the discrete-event simulator on
analytic H800 nodes with the efficiency scale calibrated on DeepSeek's profile
(`sim.deployments`, nothing refitted here), then the day's per-node averages, utilisation and
per-user decode speed against the published 73.7k / 14.8k tok/s per node and 20-22 tok/s.

    .venv/bin/python benchmarks/sim_deepseek_day.py --out benchmarks/results/sim_deepseek_day.json

Per hour, two steady-state runs at that hour's load per node (the pools are disaggregated, so
each is run with the other one never in its way). A simulated worker is one GPU whose EP peers
carry the same load (attention is data-parallel: a node is 8 such GPUs side by side):
  prefill   four GPUs of an EP32 unit, Poisson arrivals of the hour's input tokens per prefill
            node, prompts of 4,384 tokens of which 56.3% a shared prefix in the store, 1 output
            token; delivered input tok/s per node, utilisation, TTFT
  decode    one GPU of an EP144 unit fed by four prefill GPUs, Poisson arrivals of the hour's output tokens
            per decode node, KV 4,989 tokens per output token on average (prompts of 4,789 +
            400 output tokens; the output is shortened so an hour's window reaches steady
            state), MTP with one draft token at 60% acceptance (the calibration's reading):
            the simulated sequence takes 400 / 1.6 steps of 2 query rows; delivered output tok/s
            per node in the window's second half, TPOT, batch
The day's averages are the delivered tokens over each role's node-seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.bench.workloads import WorkloadConfig, build_workload  # noqa: E402
from deepinfer.sim import cluster_from_dict, simulate_workload  # noqa: E402
from deepinfer.sim import published_deployments as published  # noqa: E402
from deepinfer.sim.analytic_model import analytic_model  # noqa: E402
from deepinfer.sim.deployments import BASE_ATTN_MFU, BASE_MFU, calibrate  # noqa: E402
from deepinfer.sim.diurnal import (PUBLISHED, HourLoad, HourResult, day_averages,  # noqa: E402
                                   day_loads, request_shape)
from deepinfer.sim.hardware import accelerator  # noqa: E402
from deepinfer.sim.roofline import RooflineConfig, kv_cache_blocks  # noqa: E402

BLOCK = 64
HIT_RATE = PUBLISHED["hit_rate"]
MTP_DRAFT, MTP_ACCEPT = 1, 0.6
DECODE_OUTPUT = 400  # real tokens per request in the decode runs (KV per token kept)


GPUS_PER_NODE = 8


def node_cost(scale: float, ep: int, dedup: bool, mtp: int = 0) -> dict:
    return {"accelerator": "H800", "model": "deepseek-v3", "num_accelerators": 1,
            "ep_size": ep, "num_redundant_experts": 32, "node_dedup": dedup,
            "mfu": BASE_MFU / scale, "attn_mfu": BASE_ATTN_MFU / scale, "overlap": 1.0,
            "mtp_draft_tokens": mtp}


def blocks(cost: dict) -> int:
    keys = {k: v for k, v in cost.items() if k not in ("accelerator", "model")}
    return kv_cache_blocks(analytic_model("deepseek-v3"), accelerator("H800"),
                           RooflineConfig(**keys), BLOCK)


def cluster(scale: float, num_prefill: int, num_decode: int):
    prefill, decode = node_cost(scale, 32, True), node_cost(scale, 144, False, MTP_DRAFT)
    return cluster_from_dict({
        "pools": {
            "prefill": {"workers": num_prefill, "cost": prefill, "engine": {
                "num_kv_blocks": blocks(prefill), "max_num_seqs": 64,
                "max_num_batched_tokens": 16384}},
            "decode": {"workers": num_decode, "cost": decode, "engine": {
                "num_kv_blocks": blocks(decode), "max_num_seqs": 4096,
                "max_num_batched_tokens": 8 * 16384}}},
        "engine": {"block_size": BLOCK, "max_model_len": 131072},
        # 3FS: ~6.6 TiB/s read over 180 nodes ~ 40 GB/s per node, 5 per GPU; RDMA KV transfer
        # over the GPU's own 400 Gb/s NIC.
        "prefix_store": {"bandwidth_gb_s": 5.0, "latency_ms": 1.0},
        "kv_transfer": {"bandwidth_gb_s": 40.0, "latency_ms": 0.5},
        "front_latency_ms": 0.0})


def prefill_hour(scale: float, load: HourLoad, window_s: float, seed: int) -> dict:
    prompt, _ = request_shape()
    prompt = int(round(prompt))
    # the shared prefix in whole blocks, so the hit rate lands on the published 56.3%
    shared = -(-int(round(prompt * HIT_RATE)) // BLOCK) * BLOCK
    rate = 4 * load.input_per_prefill_node / GPUS_PER_NODE / prompt
    cfg = WorkloadConfig(kind="shared-prefix", num_prompts=max(8, int(rate * window_s)),
                         input_len=prompt - shared, shared_prefix_len=shared, num_groups=8,
                         output_len=1, request_rate=rate, seed=seed)
    run = simulate_workload(cluster(scale, 4, 1), build_workload(cfg))
    span = max(r.finished_s for r in run.records) - min(r.arrival_s for r in run.records)
    tokens = sum(r.prompt_len for r in run.records)
    ttfts = [r.ttft_s for r in run.results if r.ttft_s is not None]
    busy = sum(w.busy_time_s for w in run.simulator.pools["prefill"])
    return {"input_tok_s_per_node": tokens / span / 4 * GPUS_PER_NODE,
            "utilization": busy / (4 * span),
            "ttft_p50_ms": 1e3 * float(np.median(ttfts)), "hit_rate": run.prefix_cache_hit_rate,
            "requests": len(run.records), "wall_s": run.wall_s}


def decode_hour(scale: float, load: HourLoad, window_s: float, seed: int) -> dict:
    kv = PUBLISHED["kv_len_per_output_token"]
    prompt = int(kv - DECODE_OUTPUT / 2)
    per_step = 1 + MTP_ACCEPT * MTP_DRAFT
    steps = int(round(DECODE_OUTPUT / per_step))
    rate = load.output_per_decode_node / GPUS_PER_NODE / DECODE_OUTPUT
    cfg = WorkloadConfig(kind="shared-prefix", num_prompts=max(8, int(rate * window_s)),
                         input_len=64, shared_prefix_len=prompt - 64, num_groups=8,
                         output_len=steps, request_rate=rate, seed=seed)
    run = simulate_workload(cluster(scale, 4, 1), build_workload(cfg))
    (worker,) = run.simulator.pools["decode"]
    lo, hi = window_s / 2, window_s  # the second half: the batch has built up
    times = np.concatenate([np.asarray(r.token_times_s[1:]) for r in run.records])
    in_window = np.count_nonzero((times >= lo) & (times < hi))
    tpots = [(r.token_times_s[-1] - r.token_times_s[1]) / (len(r.token_times_s) - 2)
             for r in run.records if len(r.token_times_s) > 2 and r.arrival_s >= lo / 2]
    return {"output_tok_s_per_node": in_window * per_step / (hi - lo) * GPUS_PER_NODE,
            "utilization": worker.busy_time_s / max(times.max(), 1e-9),
            "tpot_p50_ms": 1e3 * float(np.median(tpots)) / per_step,
            "batch_mean": len(times) / max(1, worker.num_steps) * GPUS_PER_NODE,
            "requests": len(run.records), "wall_s": run.wall_s}


def capacity(scale: float) -> dict:
    """Saturated throughput per GPU at production settings (the calibrated roofline at a full
    batch: 16K prefill tokens per GPU of 4,384-token prompts; 128 sequences per GPU at 4,989
    KV with MTP), and per accelerator of a cluster split to the day's token mix at a hit rate
    (cache hits cost only their store load, so prefill capacity counts computed tokens)."""
    from dataclasses import replace

    from deepinfer.sim.deployments import predict
    prompt, _ = request_shape()
    prefill, decode = published.CALIBRATION
    computed = predict(replace(prefill, prompt_len=int(round(prompt))), scale)
    out = predict(replace(decode, ep_size=144, num_redundant_experts=32,
                          prompt_len=PUBLISHED["kv_len_per_output_token"]), scale)
    per_gpu_in, per_gpu_out = computed.predicted_tok_s / 8, out.predicted_tok_s / 8
    # GB200 at vLLM's published settings (the same calibrated model; 2K in / 2K out)
    gb_in, gb_out = (predict(d, scale).predicted_tok_s for d in published.vllm(0.5))
    input_share = 608 / 776

    def mixed(prefill: float, decode: float, hit_rate: float) -> float:
        return 1.0 / (input_share * (1 - hit_rate) / prefill + (1 - input_share) / decode)
    hits = (HIT_RATE, 0.96)
    return {"prefill_computed_tok_s_per_gpu": per_gpu_in, "decode_tok_s_per_gpu": per_gpu_out,
            "decode_step_ms": out.step_ms,
            "per_accelerator": {f"{h:.3f}": mixed(per_gpu_in, per_gpu_out, h) for h in hits},
            "gb200": {"prefill_computed_tok_s_per_gpu": gb_in, "decode_tok_s_per_gpu": gb_out,
                      "per_accelerator": {f"{h:.3f}": mixed(gb_in, gb_out, h) for h in hits}}}


def simulate_day(scale: float, window_s: float, hours: list[int] | None = None,
                 seed: int = 0) -> tuple[list[HourResult], list[dict]]:
    results, raw = [], []
    for load in day_loads():
        if hours is not None and load.hour not in hours:
            continue
        p = prefill_hour(scale, load, window_s, seed + load.hour)
        d = decode_hour(scale, load, window_s, seed + load.hour)
        results.append(HourResult(load, min(p["input_tok_s_per_node"], load.input_per_prefill_node),
                                  min(d["output_tok_s_per_node"], load.output_per_decode_node),
                                  p["utilization"], d["utilization"], p["ttft_p50_ms"],
                                  d["tpot_p50_ms"], d["batch_mean"]))
        raw.append({"hour": load.clock, "prefill": p, "decode": d})
    return results, raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window-s", type=float, default=240.0,
                        help="simulated seconds of arrivals per hour and pool")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_deepseek_day.json"))
    args = parser.parse_args()
    if not args.window_s > 0:
        parser.exit(2, "sim_deepseek_day: --window-s must be positive\n")
    start = time.perf_counter()
    calibration = calibrate(published.CALIBRATION)
    scale = calibration["efficiency_scale"]
    hours, raw = simulate_day(scale, args.window_s)
    for h, r in zip(hours, raw):
        print(f"{h.load.clock} nodes {h.load.nodes:5.1f} (P {h.load.prefill_nodes:5.1f} / D "
              f"{h.load.decode_nodes:5.1f}): prefill {h.input_tok_s_per_prefill_node:8,.0f} of "
              f"{h.load.input_per_prefill_node:8,.0f} tok/s/node, util {h.prefill_utilization:.2f}, "
              f"TTFT p50 {h.ttft_p50_ms:6.0f} ms | decode {h.output_tok_s_per_decode_node:7,.0f} "
              f"of {h.load.output_per_decode_node:7,.0f}, util {h.decode_utilization:.2f}, batch "
              f"{h.decode_batch_mean:5.0f}, {1e3 / h.tpot_p50_ms:5.1f} tok/s/user", flush=True)
    day = day_averages(hours)
    weights = [r["prefill"]["requests"] for r in raw]
    day["hit_rate"] = sum(w * r["prefill"]["hit_rate"] for w, r in zip(weights, raw)) / sum(weights)
    cap = capacity(scale)
    print(f"capacity per GPU at full batch: prefill {cap['prefill_computed_tok_s_per_gpu']:,.0f} "
          f"computed tok/s, decode {cap['decode_tok_s_per_gpu']:,.0f} tok/s; per accelerator at "
          f"the day's mix: " + ", ".join(f"{v:,.0f} at {float(k):.1%} hits"
                                         for k, v in cap["per_accelerator"].items()))
    print(f"day: {day['input_tok_s_per_prefill_node']:,.0f} input tok/s per prefill node "
          f"(published {PUBLISHED['input_tok_s_per_prefill_node']:,}), "
          f"{day['output_tok_s_per_decode_node']:,.0f} output tok/s per decode node (published "
          f"{PUBLISHED['output_tok_s_per_decode_node']:,}), {day['user_tok_s']:.1f} tok/s per "
          f"user (published 20-22), utilisation prefill {day['prefill_utilization']:.2f} / "
          f"decode {day['decode_utilization']:.2f}")
    out = {"published": PUBLISHED, "calibration": calibration, "window_s": args.window_s,
           "mtp": {"draft_tokens": MTP_DRAFT, "acceptance": MTP_ACCEPT},
           "day": day, "capacity": cap, "hours": [h.to_dict() for h in hours], "runs": raw,
           "wall_s": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out} in {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
