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

With --expert-load JSON (a `cost.expert_load` mapping, sim.expert_load) the prefill and decode
runs are made twice, balanced (as above) and with that expert load and the engine's EPLB planner
in the loop, side by side, plus the load model on eplb_bench.py's shape against its measured
balancedness; written to sim_deepseek_v3_h800_eplb.json (the planner projection is skipped):

    .venv/bin/python benchmarks/sim_deepseek.py --expert-load \
        '{"exponent": 0.5, "drift_per_minute": 0.1, "initial": "planned", "window_size": 400, "step_interval": 400}'
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
from deepinfer.moe.eplb import placement_from_phy2log, plan_placement  # noqa: E402
from deepinfer.sim.economics import Fleet, PriceSheet, TokenVolume, economics  # noqa: E402
from deepinfer.sim.expert_load import ExpertLoadSpec, initial_log_shares, shares_of  # noqa: E402
from deepinfer.sim.hardware import accelerator  # noqa: E402
from deepinfer.sim.planner import SLO, plan  # noqa: E402
from deepinfer.sim.roofline import RooflineConfig, kv_cache_blocks  # noqa: E402

# shared/traces beside the checkout (/work/main) or above it (a worktree under /work/wt)
TRACE = next((p / "shared" / "traces" for p in ROOT.parents if (p / "shared" / "traces").is_dir()),
             ROOT.parent / "shared" / "traces") / "mooncake" / "conversation_trace.jsonl"
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
            prefill_tokens: int = 8 * 16384, expert_load: dict | None = None):
    load = {} if expert_load is None else {"expert_load": expert_load}
    return cluster_from_dict({
        "pools": {
            "prefill": {"workers": num_prefill, "cost": {**PREFILL_COST, **load}, "engine": {
                "num_kv_blocks": blocks_for(PREFILL_COST), "max_num_seqs": 512,
                "max_num_batched_tokens": prefill_tokens}},
            "decode": {"workers": num_decode, "cost": {**DECODE_COST, **load}, "engine": {
                "num_kv_blocks": blocks_for(DECODE_COST), "max_num_seqs": decode_seqs,
                "max_num_batched_tokens": 8 * 16384}}},
        "engine": {"block_size": BLOCK, "max_model_len": 131072},
        # 3FS: ~6.6 TiB/s read over 180 nodes ~ 40 GB/s per node; RDMA KV transfer per node.
        "prefix_store": {"bandwidth_gb_s": 40.0, "latency_ms": 1.0},
        "kv_transfer": {"bandwidth_gb_s": 40.0, "latency_ms": 0.5},
        "front_latency_ms": 0.0})


def expert_load_stats(run, role: str) -> dict | None:
    """The pool's EPLB in the loop: step-weighted means over its workers (None: balanced)."""
    stats = [w.step_model.expert_load_stats() for w in run.simulator.pools[role]]
    stats = [s for s in stats if s is not None and s["num_steps"]]
    if not stats:
        return None
    steps = sum(s["num_steps"] for s in stats)
    out = {"num_steps": steps, "num_rebalances": sum(s["num_rebalances"] for s in stats),
           "moved_bytes": sum(s["moved_bytes"] for s in stats),
           "rebalance_s": sum(s["rebalance_s"] for s in stats)}
    for key in ("balancedness_mean", "imbalance_mean", "imbalance_token_weighted"):
        out[key] = sum(s[key] * s["num_steps"] for s in stats) / steps
    return out


def prefill_throughput(expert_load: dict | None = None) -> dict:
    cfg = WorkloadConfig(kind="shared-prefix", num_prompts=400, input_len=1922, output_len=1,
                         num_groups=8, shared_prefix_len=2478, request_rate=float("inf"))
    run = simulate_workload(cluster(1, 1, expert_load=expert_load), build_workload(cfg))
    span = max(r.finished_s for r in run.records)
    tokens = sum(r.prompt_len for r in run.records)
    per_node = tokens / span
    out = {"input_tok_s_per_node": per_node, "hit_rate": run.prefix_cache_hit_rate,
           "ratio_to_published": per_node / PUBLISHED["prefill_input_tok_s_per_node"],
           "wall_s": run.wall_s}
    if expert_load is not None:
        out["expert_load"] = expert_load_stats(run, "prefill")
    return out


def decode_throughput(seqs_per_node: int, expert_load: dict | None = None) -> dict:
    # The decode batch is set by the requests in flight: a decode worker admits every
    # transferred prompt its KV cache can hold (the engine's `allocate_for_transfer` does
    # not apply max_num_seqs), so B requests at once on one decode node give a batch of ~B
    # for most of the run. Enough prefill nodes that the decode node is the bottleneck.
    cfg = WorkloadConfig(kind="random", num_prompts=seqs_per_node, input_len=4400,
                         output_len=1200, request_rate=float("inf"))
    run = simulate_workload(cluster(8, 1, decode_seqs=seqs_per_node, expert_load=expert_load),
                            build_workload(cfg))
    times = np.sort(np.concatenate([np.asarray(r.token_times_s[1:]) for r in run.records]))
    lo, hi = np.quantile(times, [0.3, 0.7])  # the steady middle of the run
    in_window = np.count_nonzero((times >= lo) & (times <= hi))
    per_node = in_window / (hi - lo)
    summary = run.summary()
    out = {"seqs_per_node": seqs_per_node, "output_tok_s_per_node": per_node,
           "tpot_p50_ms": summary.tpot_ms.p50,
           "ratio_to_published": per_node / PUBLISHED["decode_output_tok_s_per_node"],
           "wall_s": run.wall_s}
    if expert_load is not None:
        out["expert_load"] = expert_load_stats(run, "decode")
    return out


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


def zipf_for_top4_share(share: float, num_layers: int, num_experts: int, seed: int) -> float:
    """The Zipf exponent whose expected top-4 share of layer-summed pairs is `share` (the
    statistic eplb_bench.py prints: experts summed over layers, each layer its permutation)."""
    def top4(exponent):
        spec = ExpertLoadSpec(exponent=exponent, seed=seed)
        summed = shares_of(initial_log_shares(spec, num_layers, num_experts)).sum(0)
        return np.sort(summed)[::-1][:4].sum() / num_layers
    lo, hi = 0.0, 8.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if top4(mid) < share else (lo, mid)
    return (lo + hi) / 2


def eplb_bench_shape(expert_load: dict) -> dict | None:
    """The load model on eplb_bench.py's shape (E experts, top-k, EP ranks, its steps and
    window), Zipf exponent set to reproduce its measured top-4 token share, planned offline
    as its `plan_offline` does: balancedness of the static layout, and of each window's plan
    on that window and on the next, against eplb_bench.json's measured numbers."""
    path = RESULTS / "eplb_bench.json"
    if not path.exists():
        return None
    bench = json.loads(path.read_text())
    c = bench["config"]
    e, k, ranks, layers, window = c["experts"], c["top_k"], c["ranks"], c["layers"], c["window"]
    steps = bench["offline"]["num_steps"]
    seed = ExpertLoadSpec.from_value(expert_load).seed
    exponent = zipf_for_top4_share(bench["top4_token_share"], layers, e, seed)
    tokens_per_step = c["requests"] * (c["prompt_len"] + c["max_tokens"]) / steps
    shares = shares_of(initial_log_shares(ExpertLoadSpec(exponent=exponent, seed=seed), layers, e))
    rng = np.random.default_rng([seed, 1])
    loads = np.stack([rng.multinomial(round(tokens_per_step * k), shares) for _ in range(steps)])
    windows = [loads[i:i + window].sum(0) for i in range(0, steps - window + 1, window)]
    static = placement_from_phy2log(np.tile(np.arange(e), (layers, 1)), e, ranks)
    sim = {"static": float(np.mean([static.balancedness(w).mean() for w in windows]))}
    for r in (0, e // 8, e // 4, e // 2):
        plans = [plan_placement(w, e + r, ranks) for w in windows]
        sim[str(r)] = {
            "planned_window": float(np.mean([p.balancedness(w).mean()
                                             for p, w in zip(plans, windows)])),
            "next_window": float(np.mean([p.balancedness(w).mean()
                                          for p, w in zip(plans, windows[1:])]))}
    return {"shape": {"experts": e, "top_k": k, "ranks": ranks, "layers": layers,
                      "steps": steps, "window": window, "tokens_per_step": tokens_per_step},
            "top4_token_share": bench["top4_token_share"], "zipf_exponent": exponent,
            "simulated": sim, "measured": bench["offline"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-batches", default="512,768,1024")
    parser.add_argument("--plan-prompts", type=int, default=600)
    parser.add_argument("--max-prefill", type=int, default=12)
    parser.add_argument("--max-decode", type=int, default=4)
    parser.add_argument("--expert-load", default=None, metavar="JSON",
                        help="a cost.expert_load mapping: compare balanced with it, EPLB in "
                             "the loop (skips the planner projection)")
    parser.add_argument("--out", default=None, help="JSON output (default: "
                        "sim_deepseek_v3_h800.json, with --expert-load ..._eplb.json)")
    args = parser.parse_args()
    expert_load = None
    if args.expert_load is not None:
        try:
            expert_load = json.loads(args.expert_load)
            ExpertLoadSpec.from_value(expert_load)
        except ValueError as e:  # JSONDecodeError is one
            parser.exit(2, f"--expert-load: {e}\n")
    out_path = args.out or str(RESULTS / ("sim_deepseek_v3_h800.json" if expert_load is None
                                          else "sim_deepseek_v3_h800_eplb.json"))
    start = time.perf_counter()
    model = analytic_model("deepseek-v3")
    roofline = {k: v for k, v in RooflineConfig().__dict__.items() if k != "expert_load"}
    report = {"published": PUBLISHED, "assumptions": {
        "model": f"{model.name}: {model.total_params / 1e9:.0f}B params, "
                 f"{model.active_params / 1e9:.1f}B active, fp8 weights and GEMMs, "
                 f"bf16 MLA latent KV {model.kv_bytes_per_token} B/token",
        "accelerator": accelerator("H800").__dict__, "prefill_cost": PREFILL_COST,
        "decode_cost": DECODE_COST, "roofline": roofline,
        "kv_blocks_per_node": {"prefill": blocks_for(PREFILL_COST),
                               "decode": blocks_for(DECODE_COST)}, "block_size": BLOCK}}
    if expert_load is not None:
        report["assumptions"]["expert_load"] = expert_load
    variants = [None] if expert_load is None else [None, expert_load]
    for load in variants:
        key = "prefill" if load is None else "prefill_expert_load"
        row = report[key] = prefill_throughput(load)
        print(f"{key}: {row['input_tok_s_per_node']:,.0f} input tok/s per node "
              f"(hit {100 * row['hit_rate']:.1f}%), "
              f"{row['ratio_to_published']:.2f}x published" + describe_load(row), flush=True)
    for load in variants:
        key = "decode" if load is None else "decode_expert_load"
        report[key] = []
        for seqs in (int(x) for x in args.decode_batches.split(",")):
            row = decode_throughput(seqs, load)
            report[key].append(row)
            print(f"{key} batch {seqs}/node: {row['output_tok_s_per_node']:,.0f} output tok/s "
                  f"per node, TPOT p50 {row['tpot_p50_ms']:.1f} ms, "
                  f"{row['ratio_to_published']:.2f}x published" + describe_load(row), flush=True)
    if expert_load is None:
        report["plan"] = planner_projection(args.plan_prompts, args.max_prefill, args.max_decode)
        best = report["plan"]["best"]
        print(f"plan: best {best and best['workers']}; economics "
              f"{json.dumps(report['plan'].get('economics'), default=str)[:400]}")
    else:
        shape = report["eplb_bench_shape"] = eplb_bench_shape(expert_load)
        if shape is not None:
            sim, measured = shape["simulated"], shape["measured"]
            print(f"eplb_bench shape (Zipf {shape['zipf_exponent']:.2f} for its top-4 share "
                  f"{shape['top4_token_share']:.2f}): static balancedness {sim['static']:.3f} "
                  f"(measured {measured['static']:.3f}); next window " + ", ".join(
                      f"+{r} {sim[r]['next_window']:.3f} ({measured[r]['next_window']:.3f})"
                      for r in sim if r != "static"))
    report["wall_s"] = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1, default=lambda x: None)
    print(f"wrote {out_path} in {report['wall_s']:.0f} s")


def describe_load(row: dict) -> str:
    load = row.get("expert_load")
    if not load:
        return ""
    return (f"; expert load: balancedness {load['balancedness_mean']:.3f}, step imbalance "
            f"{load['imbalance_token_weighted']:.3f} (token-weighted), "
            f"{load['num_rebalances']} rebalances ({load['rebalance_s']:.2f} s of moves)")


if __name__ == "__main__":
    main()
