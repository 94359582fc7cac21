"""EPLB on skewed routing: balancedness, step time and memory for 0, E/8, E/4, E/2 redundant
experts with EP=4 (gloo rank processes on this machine).

    python benchmarks/eplb_bench.py --json benchmarks/results/eplb_bench.json \
        --plot benchmarks/results/eplb_bench.png

The model is a small random DeepSeek-V3 (MLA, sigmoid routing; E routed experts, top-k) whose
router carries a Zipf bias: `e_score_correction_bias` (which only steers selection) is set to
bias * (1/rank)^s over a random permutation of the experts per layer, so a few experts take most
tokens, and they do not sit on one rank by construction.

Two measurements:
1. Loads recorded from a real run (one process, the same prompts; tokens per layer per expert
   per step) are planned offline with moe/eplb.py in windows of --window steps: balancedness
   (mean / max rank load, mean over layers and windows) on the window the plan was made from
   and on the next window, against the static layout (slot p holds expert p % E).
2. The EP=4 group itself, EPLB on (rebalance every --window steps over a --window-step window)
   for each redundancy, and EPLB off: the balancedness the ranks actually saw (each rebalance's
   "before": the previous plan on the window just served), the expert CPU time per step of the
   busiest and of the mean rank (thread CPU time: what the busiest rank makes the others wait
   for when each rank has its own device; the static layout's numbers come from the warm-up
   pass's first window, the EPLB numbers from the same steps of the measured pass), median
   inter-token latency (the group's decode step time) and throughput of a fixed batch after a
   warm-up pass, expert bytes per rank and bytes held by redundant experts.
On a 2-core machine the 4 ranks share 2 cores, so waiting ranks free CPU for the busy one:
step-time gains understate what ranks with their own accelerators would see.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import numpy as np
import torch

from deepinfer.moe.eplb import placement_from_phy2log, plan_placement


def build_checkpoint(directory: str, args) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from deepinfer.runtime.model_source import resolve_model

    config = DeepseekV3Config(
        vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers + 1,
        num_attention_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.expert_size, n_routed_experts=args.experts, n_shared_experts=1,
        num_experts_per_tok=args.top_k, n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    zipf = (1.0 / np.arange(1, args.experts + 1)) ** args.zipf_s
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen) / args.hidden ** 0.5 * 8)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.tensor(args.bias * zipf[rng.permutation(args.experts)]))
    model.save_pretrained(directory)
    resolve_model(None).load_tokenizer().save_pretrained(directory)


def workload(args) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 512, args.prompt_len).tolist() for _ in range(args.requests)]


def params(args):
    from deepinfer import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)


def record_loads(directory: str, args) -> np.ndarray:
    """[steps, layers, experts] tokens per expert from one process serving the workload."""
    from deepinfer import LLM
    from deepinfer.moe.expert_parallel import moe_blocks

    llm = LLM(model=directory, dtype="float32", num_kv_blocks=512, num_threads=1,
              max_num_seqs=args.requests // args.ranks)
    blocks = moe_blocks(llm.engine.model)
    step_loads: list[np.ndarray] = []
    current = np.zeros((len(blocks), args.experts), dtype=np.int64)

    def recorder(i, forward):
        def wrapped(x, weights, ids):
            current[i] += np.bincount(ids.reshape(-1).numpy(), minlength=args.experts)
            if i == len(blocks) - 1:
                step_loads.append(current.copy())
                current[:] = 0
            return forward(x, weights, ids)
        return wrapped

    for i, block in enumerate(blocks):
        block.experts.forward = recorder(i, block.experts.forward)
    llm.generate([{"prompt_token_ids": p} for p in workload(args)], params(args), use_tqdm=False)
    return np.stack(step_loads)


def plan_offline(loads: np.ndarray, args) -> dict:
    """Balancedness of plans made per window, on that window and on the next."""
    e, w = args.experts, args.window
    windows = [loads[i:i + w].sum(0) for i in range(0, loads.shape[0] - w + 1, w)]
    static = placement_from_phy2log(np.tile(np.arange(e), (loads.shape[1], 1)), e, args.ranks)
    out = {"num_steps": int(loads.shape[0]), "num_windows": len(windows),
           "static": float(np.mean([static.balancedness(win).mean() for win in windows]))}
    for r in redundancies(args):
        planned, following = [], []
        for i, win in enumerate(windows):
            placement = plan_placement(win, e + r, args.ranks)
            planned.append(placement.balancedness(win).mean())
            if i + 1 < len(windows):
                following.append(placement.balancedness(windows[i + 1]).mean())
        out[str(r)] = {"planned_window": float(np.mean(planned)),
                       "next_window": float(np.mean(following)) if following else None}
    return out


def redundancies(args) -> list[int]:
    return [0, args.experts // 8, args.experts // 4, args.experts // 2]


async def run_group(directory: str, args, redundant: int | None) -> dict:
    """One EP=4 group; `redundant` None: EPLB off."""
    from deepinfer.engine.engine_config import EngineConfig
    from deepinfer.clients.factory import make_client
    from deepinfer.ep.ep_config import EPConfig
    from deepinfer.moe.eplb_config import EPLBConfig

    eplb = redundant is not None
    ep = EPConfig(data_parallel_size=args.ranks, enable_expert_parallel=True, enable_eplb=eplb,
                  eplb=EPLBConfig(window_size=args.window, step_interval=args.window,
                                  num_redundant_experts=redundant or 0,
                                  plan_ahead_steps=args.plan_ahead))
    config = EngineConfig(model=directory, dtype="float32", num_kv_blocks=512, num_threads=1,
                          max_num_seqs=args.requests // args.ranks)
    client = make_client(config, ep_config=ep, ready_timeout_s=600)
    await client.start()
    try:
        prompts, sampling = workload(args), params(args)

        async def one(i, prompt):
            times = []
            async for delta in client.generate(f"{i}-{time.monotonic()}", prompt, sampling):
                times += [time.monotonic()] * len(delta.choices[0].token_ids)
            return times

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))  # warm-up: plans adapt
        group = client.groups[0]
        first = group.eplb_history[0] if group.eplb_history else None  # static layout's window
        seen = len(group.eplb_history)
        start = time.monotonic()
        arrivals = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.monotonic() - start
        history = group.eplb_history[seen:]
        itl = np.concatenate([np.diff(t) for t in arrivals if len(t) > 1])
        expert = args.hidden * args.expert_size * 3 * 4  # one expert's fp32 bytes

        def mean(values):
            return float(np.mean(values)) if values else None
        return {
            "redundant_experts": redundant, "eplb": eplb,
            "static_balancedness": None if first is None else float(np.mean(first.balancedness_before)),
            "static_expert_cpu_ms_max": None if first is None else first.expert_cpu_ms_max,
            "static_expert_cpu_ms_mean": None if first is None else first.expert_cpu_ms_mean,
            "realized_balancedness": mean([np.mean(h.balancedness_before) for h in history]),
            "planned_balancedness": mean([np.mean(h.balancedness_after) for h in history]),
            # The pass's first window: the same steps (prefill + early decode) as the static
            # layout's window above, now on the layout planned during the warm-up.
            "first_window_balancedness": float(np.mean(history[0].balancedness_before)) if history else None,
            "expert_cpu_ms_max": history[0].expert_cpu_ms_max if history else None,
            "expert_cpu_ms_mean": history[0].expert_cpu_ms_mean if history else None,
            "num_rebalances": group.num_rebalances,
            "rebalance_ms_mean": mean([h.duration_s * 1e3 for h in history]),  # steps stalled
            "plan_ms_mean": mean([h.plan_s * 1e3 for h in history]),
            "moved_bytes_per_rebalance": mean([h.moved_bytes for h in history]),
            "itl_median_ms": float(np.median(itl) * 1e3), "itl_mean_ms": float(itl.mean() * 1e3),
            "output_tokens_per_s": args.requests * args.max_tokens / wall,
            "expert_bytes_per_rank": (args.experts + (redundant or 0)) // args.ranks * expert * args.layers,
            "redundant_expert_bytes": client.redundant_expert_bytes,
        }
    finally:
        await client.shutdown()


def describe(run: dict) -> str:
    def num(key, fmt=".3f"):
        return "n/a" if run[key] is None else format(run[key], fmt)
    return (f"balancedness static {num('static_balancedness')} -> "
            f"{num('first_window_balancedness')} same steps, {num('realized_balancedness')} over "
            f"the pass (planned {num('planned_balancedness')}); busiest "
            f"rank expert CPU {num('static_expert_cpu_ms_max', '.1f')} -> "
            f"{num('expert_cpu_ms_max', '.1f')} ms/step (mean rank {num('expert_cpu_ms_mean', '.1f')}); "
            f"ITL median {run['itl_median_ms']:.1f} ms, {run['output_tokens_per_s']:.0f} tok/s; "
            f"rebalance stalls steps {num('rebalance_ms_mean', '.0f')} ms (planning "
            f"{num('plan_ms_mean', '.0f')} ms) moving "
            f"{num('moved_bytes_per_rebalance', '.0f')} B; experts "
            f"{run['expert_bytes_per_rank'] / 2**20:.1f} MiB/rank, redundant "
            f"{run['redundant_expert_bytes'] / 2**20:.1f} MiB")


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["ep_runs"] if r["eplb"]]
    xs = [r["redundant_experts"] for r in runs]
    base = next(r for r in results["ep_runs"] if not r["eplb"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    offline = results["offline"]
    ax1.plot(xs, [offline[str(x)]["planned_window"] for x in xs], "o--", label="planned window (recorded loads)")
    ax1.plot(xs, [offline[str(x)]["next_window"] for x in xs], "s--", label="next window (recorded loads)")
    ax1.plot(xs, [r["realized_balancedness"] for r in runs], "^-", label="EP=4 run, realized")
    ax1.axhline(offline["static"], color="grey", ls=":", label="static layout (no EPLB)")
    ax1.set_xlabel("redundant experts"), ax1.set_ylabel("balancedness (mean/max rank load)")
    ax1.set_ylim(0, 1.05), ax1.legend(fontsize=8), ax1.set_title("balance")
    static = runs[0]
    ax2.plot(xs, [r["expert_cpu_ms_max"] for r in runs], "o-", label="busiest rank: expert CPU ms/step")
    ax2.plot(xs, [r["expert_cpu_ms_mean"] for r in runs], "s-", label="mean rank: expert CPU ms/step")
    ax2.axhline(static["static_expert_cpu_ms_max"], color="grey", ls=":",
                label="busiest rank, static layout")
    ax2.plot(xs, [r["itl_median_ms"] for r in runs], "^--", label="median ITL (wall, 2 shared cores)")
    ax2.axhline(base["itl_median_ms"], color="C2", ls=":", label="median ITL, EPLB off")
    ax2.set_xlabel("redundant experts"), ax2.set_ylabel("ms")
    mem = ax2.twinx()
    mem.bar(xs, [r["redundant_expert_bytes"] / 2**20 for r in runs], alpha=0.2, width=1.5, color="C3")
    mem.set_ylabel("redundant expert memory, group (MiB)", color="C3")
    ax2.legend(fontsize=8), ax2.set_title("step time and memory")
    fig.suptitle(f"EPLB, EP={results['config']['ranks']}, E={results['config']['experts']}, Zipf-biased router")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-size", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3, help="MoE layers (after one dense layer)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--zipf-s", type=float, default=1.5)
    ap.add_argument("--bias", type=float, default=2.0)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=8, help="EPLB window and step interval")
    ap.add_argument("--plan-ahead", type=int, default=-1,
                    help="eplb plan_ahead_steps (-1: auto, 0: plan at the due step)")
    ap.add_argument("--offline-only", action="store_true", help="skip the EP=4 runs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        build_checkpoint(directory, args)
        loads = record_loads(directory, args)
        offline = plan_offline(loads, args)
        share = np.sort(loads.sum((0, 1)))[::-1] / loads.sum()
        print(f"recorded {loads.shape[0]} steps; top-4 experts take {share[:4].sum():.0%} of tokens")
        print(f"offline static layout balancedness {offline['static']:.3f}")
        for r in redundancies(args):
            print(f"  +{r:2d} redundant: planned {offline[str(r)]['planned_window']:.3f}, "
                  f"next window {offline[str(r)]['next_window']:.3f}")
        runs = []
        for redundant in [] if args.offline_only else [None] + redundancies(args):
            run = asyncio.run(run_group(directory, args, redundant))
            runs.append(run)
            label = "EPLB off" if redundant is None else f"+{redundant:2d} redundant"
            print(f"EP={args.ranks} {label}: " + describe(run), flush=True)
    results = {"config": vars(args), "top4_token_share": float(share[:4].sum()),
               "offline": offline, "ep_runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot and runs:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
