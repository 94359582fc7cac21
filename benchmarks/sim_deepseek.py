"""DeepSeek-V3 on analytic H800 nodes: simulated per-node throughput vs DeepSeek's published
figures, and an economics projection from the planner (cost per million tokens vs P:D).

DeepSeek's day-6 overview: each H800 node delivers ~73.7k input tok/s during prefill
(cache hits included) and ~14.8k output tok/s during decode; 56.3% cache hit rate; average
KV length per output token 4,989; 20-22 output tok/s per user. Deployment: prefill units of 4
nodes (EP32, 32 redundant experts), decode units of 18 nodes (EP144, 32 redundant experts).

Here one simulated worker is one node (8 GPUs) of such a unit; its peers in the EP group are
assumed equally loaded (all-to-all traffic is sized for the whole group). Runs:

  prefill   400 prompts of 4,400 tokens at once, 56% of each a shared prefix (8 groups),
            1 output token: input tok/s per prefill node over the busy span
  decode    B prompts of 4,400 tokens + 1,200 output tokens at once on one decode node
            (mean KV length ~5k), B swept; output tok/s per decode node in the steady middle
            of the run (30%-70% of its tokens), and TPOT
  plan      the Mooncake conversation trace (real lengths, prompts capped at 32k, time x0.1)
            on 1-node workers: P:D candidates, cost per million tokens, economics

    .venv/bin/python benchmarks/sim_deepseek.py
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

from deepinfer.bench.traces import ShrinkConfig  # noqa: E402
from deepinfer.bench.workloads import WorkloadConfig, build_workload  # noqa: E402
from deepinfer.sim import cluster_from_dict, simulate_workload  # noqa: E402
from deepinfer.sim.analytic_model import analytic_model  # noqa: E402
from deepinfer.sim.economics import Fleet, PriceSheet, TokenVolume, economics  # noqa: E402
from deepinfer.sim.hardware import accelerator  # noqa: E402
from deepinfer.sim.planner import SLO, plan  # noqa: E402
from deepinfer.sim.roofline import RooflineConfig, kv_cache_blocks  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
RESULTS = ROOT / "benchmarks" / "results"
PUBLISHED = {"prefill_input_tok_s_per_node": 73_700, "decode_output_tok_s_per_node": 14_800}
BLOCK = 64
PREFILL_COST = {"accelerator": "H800", "model": "deepseek-v3", "num_accelerators": 8,
                "ep_size": 32, "num_redundant_experts": 32, "node_dedup": True}
DECODE_COST = {"accelerator": "H800", "model": "deepseek-v3", "num_accelerators": 8,
               "ep_size": 144, "num_redundant_experts": 32, "node_dedup": False}


def blocks_for(cost: dict) -> int:
    keys = {k: v for k, v in cost.items() if k not in ("accelerator", "model")}
    return kv_cache_blocks(analytic_model("deepseek-v3"), accelerator("H800"),
                           RooflineConfig(**keys), BLOCK)


def cluster(num_prefill: int, num_decode: int, decode_seqs: int = 1024,
            prefill_tokens: int = 8 * 16384):
    return cluster_from_dict({
        "pools": {
            "prefill": {"workers": num_prefill, "cost": PREFILL_COST, "engine": {
                "num_kv_blocks": blocks_for(PREFILL_COST), "max_num_seqs": 512,
                "max_num_batched_tokens": prefill_tokens}},
            "decode": {"workers": num_decode, "cost": DECODE_COST, "engine": {
                "num_kv_blocks": blocks_for(DECODE_COST), "max_num_seqs": decode_seqs,
                "max_num_batched_tokens": 8 * 16384}}},
        "engine": {"block_size": BLOCK, "max_model_len": 131072},
        # 3FS: ~6.6 TiB/s read over 180 nodes ~ 40 GB/s per node; RDMA KV transfer per node.
        "prefix_store": {"bandwidth_gb_s": 40.0, "latency_ms": 1.0},
        "kv_transfer": {"bandwidth_gb_s": 40.0, "latency_ms": 0.5},
        "front_latency_ms": 0.0})


def prefill_throughput() -> dict:
    cfg = WorkloadConfig(kind="shared-prefix", num_prompts=400, input_len=1922, output_len=1,
                         num_groups=8, shared_prefix_len=2478, request_rate=float("inf"))
    run = simulate_workload(cluster(1, 1), build_workload(cfg))
    span = max(r.finished_s for r in run.records)
    tokens = sum(r.prompt_len for r in run.records)
    per_node = tokens / span
    return {"input_tok_s_per_node": per_node, "hit_rate": run.prefix_cache_hit_rate,
            "ratio_to_published": per_node / PUBLISHED["prefill_input_tok_s_per_node"],
            "wall_s": run.wall_s}


def decode_throughput(seqs_per_node: int) -> dict:
    # The decode batch is set by the requests in flight: a decode worker admits every
    # transferred prompt its KV cache can hold (the engine's `allocate_for_transfer` does
    # not apply max_num_seqs), so B requests at once on one decode node give a batch of ~B
    # for most of the run. Enough prefill nodes that the decode node is the bottleneck.
    cfg = WorkloadConfig(kind="random", num_prompts=seqs_per_node, input_len=4400,
                         output_len=1200, request_rate=float("inf"))
    run = simulate_workload(cluster(8, 1, decode_seqs=seqs_per_node), build_workload(cfg))
    times = np.sort(np.concatenate([np.asarray(r.token_times_s[1:]) for r in run.records]))
    lo, hi = np.quantile(times, [0.3, 0.7])  # the steady middle of the run
    in_window = np.count_nonzero((times >= lo) & (times <= hi))
    per_node = in_window / (hi - lo)
    summary = run.summary()
    return {"seqs_per_node": seqs_per_node, "output_tok_s_per_node": per_node,
            "tpot_p50_ms": summary.tpot_ms.p50,
            "ratio_to_published": per_node / PUBLISHED["decode_output_tok_s_per_node"],
            "wall_s": run.wall_s}


def planner_projection(num_prompts: int, max_prefill: int, max_decode: int) -> dict:
    cfg = WorkloadConfig(kind=f"trace:{TRACE}", num_prompts=num_prompts, time_scale=0.1,
                         shrink=ShrinkConfig(max_input_len=32768))
    workload = build_workload(cfg)
    slo = SLO(ttft_p90_ms=5000.0, tpot_p90_ms=50.0)
    result = plan(cluster(1, 1), workload, slo, max_prefill=max_prefill,
                  max_decode=max_decode, accelerator_hour_cost=2.0)
    best = result.best
    out = {"workload": workload.description, "slo": slo.__dict__,
           "candidates": [c.to_dict() for c in result.candidates],
           "best": best.to_dict() if best else None}
    if best is not None:
        sized = cluster(1, 1).with_workers(**best.workers)
        run = simulate_workload(sized, workload)
        s = run.summary()
        volume = TokenVolume.from_throughput(s.total_input_tokens / s.duration_s,
                                             s.total_output_tokens / s.duration_s,
                                             run.prefix_cache_hit_rate or 0.0)
        report = economics(volume, PriceSheet(), Fleet(best.num_accelerators, 2.0, 30_000.0))
        out["economics"] = report.to_dict()
        out["economics_assumptions"] = ("load of the replay held all day; DeepSeek prices "
                                        "$0.14/$0.55/$2.19 per M; $2/GPU-hour; capex $30k/GPU")
    from deepinfer.cli.plan import plot_plan
    plot_plan(result, str(RESULTS / "sim_plan_deepseek_v3_h800.png"),
              "DeepSeek-V3 on H800 nodes (roofline), Mooncake x10 rate: $/M tokens vs P:D")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-batches", default="512,768,1024")
    parser.add_argument("--plan-prompts", type=int, default=600)
    parser.add_argument("--max-prefill", type=int, default=12)
    parser.add_argument("--max-decode", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS / "sim_deepseek_v3_h800.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    model = analytic_model("deepseek-v3")
    report = {"published": PUBLISHED, "assumptions": {
        "model": f"{model.name}: {model.total_params / 1e9:.0f}B params, "
                 f"{model.active_params / 1e9:.1f}B active, fp8 weights and GEMMs, "
                 f"bf16 MLA latent KV {model.kv_bytes_per_token} B/token",
        "accelerator": accelerator("H800").__dict__, "prefill_cost": PREFILL_COST,
        "decode_cost": DECODE_COST, "roofline": RooflineConfig().__dict__,
        "kv_blocks_per_node": {"prefill": blocks_for(PREFILL_COST),
                               "decode": blocks_for(DECODE_COST)}, "block_size": BLOCK}}
    report["prefill"] = prefill_throughput()
    print(f"prefill: {report['prefill']['input_tok_s_per_node']:,.0f} input tok/s per node "
          f"(hit {100 * report['prefill']['hit_rate']:.1f}%), "
          f"{report['prefill']['ratio_to_published']:.2f}x published", flush=True)
    report["decode"] = []
    for seqs in (int(x) for x in args.decode_batches.split(",")):
        row = decode_throughput(seqs)
        report["decode"].append(row)
        print(f"decode batch {seqs}/node: {row['output_tok_s_per_node']:,.0f} output tok/s per "
              f"node, TPOT p50 {row['tpot_p50_ms']:.1f} ms, "
              f"{row['ratio_to_published']:.2f}x published", flush=True)
    report["plan"] = planner_projection(args.plan_prompts, args.max_prefill, args.max_decode)
    best = report["plan"]["best"]
    print(f"plan: best {best and best['workers']}; economics "
          f"{json.dumps(report['plan'].get('economics'), default=str)[:400]}")
    report["wall_s"] = time.perf_counter() - start
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=lambda x: None)
    print(f"wrote {args.out} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
