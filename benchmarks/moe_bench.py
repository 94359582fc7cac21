"""MoE benchmark, two parts, one JSON:

1. layer: `MoEExperts` (tokens sorted by expert, one matmul pair per active expert) vs a naive
   loop over every expert with a boolean mask (what the transformers reference does), at a
   DeepSeek-like small shape, for decode- and prefill-sized token counts.
2. engine: offline throughput of a tiny random-weight MoE checkpoint (DeepSeek-V3 with MLA,
   or Mixtral) in bf16 against transformers' batched `generate` on the same workload, in the
   same run, reusing `deepinfer bench offline`'s runners.

    .venv/bin/python benchmarks/moe_bench.py --threads 1 --json benchmarks/results/moe_bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepinfer.moe.moe_config import MoEConfig  # noqa: E402
from deepinfer.moe.layer import MoEExperts, naive_expert_loop  # noqa: E402
from deepinfer.moe.routing import select_experts  # noqa: E402


def per_token_loop(experts: MoEExperts, x, weights, ids):
    """The shape the grouped layer avoids: a Python loop over tokens and their k experts."""
    import torch.nn.functional as F
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(x[t:t + 1], experts.gate_up_proj[e]).split(experts.intermediate_size, dim=-1)
            out[t] += (F.linear(F.silu(gate) * up, experts.down_proj[e])[0] * weights[t, j]).to(x.dtype)
    return out


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def bench_layer(args) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    experts = MoEExperts(args.num_experts, args.hidden, args.moe_intermediate, dtype)
    experts.gate_up_proj.copy_(0.02 * torch.randn(experts.gate_up_proj.shape, generator=gen))
    experts.down_proj.copy_(0.02 * torch.randn(experts.down_proj.shape, generator=gen))
    cfg = MoEConfig(num_experts=args.num_experts, num_experts_per_tok=args.top_k,
                    moe_intermediate_size=args.moe_intermediate)
    rows = []
    for num_tokens in args.layer_tokens:
        x = torch.randn(num_tokens, args.hidden, generator=gen).to(dtype)
        weights, ids = select_experts(torch.randn(num_tokens, args.num_experts, generator=gen), cfg)
        grouped = _median_ms(lambda: experts(x, weights, ids), args.repeats)
        naive = _median_ms(lambda: naive_expert_loop(experts, x, weights, ids), args.repeats)
        diff = (experts(x, weights, ids).float() - naive_expert_loop(experts, x, weights, ids).float()).abs().max()
        per_token = (_median_ms(lambda: per_token_loop(experts, x, weights, ids), max(1, args.repeats // 2))
                     if num_tokens <= 64 else None)
        rows.append({"num_tokens": num_tokens, "grouped_ms": grouped, "naive_loop_ms": naive,
                     "per_token_loop_ms": per_token,
                     "speedup": naive / grouped, "max_abs_diff": float(diff),
                     "active_experts": int(ids.unique().numel())})
        shown = f"{per_token:9.3f}" if per_token is not None else "        -"
        print(f"layer  T={num_tokens:5d}  active experts {rows[-1]['active_experts']:3d}  "
              f"grouped {grouped:8.3f} ms  naive expert loop {naive:8.3f} ms (x{naive / grouped:4.2f})  "
              f"per-token loop {shown} ms")
    return rows


def write_tiny_checkpoint(kind: str, directory: str) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config, MixtralConfig

    from deepinfer.runtime.model_source import resolve_model

    common = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  max_position_embeddings=2048, tie_word_embeddings=False)
    if kind == "deepseek_v3":
        config = DeepseekV3Config(**common, intermediate_size=512, moe_intermediate_size=128,
                                  n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                                  n_group=4, topk_group=2, first_k_dense_replace=1,
                                  q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                                  qk_rope_head_dim=16, v_head_dim=32)
    else:
        config = MixtralConfig(**common, num_key_value_heads=4, intermediate_size=256,
                               num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    resolve_model(None).load_tokenizer().save_pretrained(directory)


def bench_engine(args) -> dict:
    from deepinfer.bench.offline import make_prompts, run_engine, run_hf
    from deepinfer.engine.engine_config import EngineConfig

    with tempfile.TemporaryDirectory() as directory:
        write_tiny_checkpoint(args.model_kind, directory)
        config = EngineConfig(model=directory, dtype="bfloat16", num_threads=args.threads,
                              kv_cache_memory="512MiB", seed=0)
        prompts = make_prompts(args.num_prompts, args.input_len, 4096, seed=0)
        ours = run_engine(config, prompts, args.output_len)
        hf = run_hf(config, prompts, args.output_len, None)
    ours_ids, hf_ids = ours.pop("_token_ids"), hf.pop("_token_ids")
    same = sum(a == b for a, b in zip(ours_ids, hf_ids))
    first_same = sum(a[:1] == b[:1] for a, b in zip(ours_ids, hf_ids))
    for r in (ours, hf):
        print(f"engine {r['name']:>10}: {r['elapsed_s']:7.2f} s  output {r['output_tokens_per_s']:8.1f} tok/s"
              f"  total {r['total_tokens_per_s']:8.1f} tok/s")
    speedup = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    print(f"engine speed-up vs transformers: {speedup:.2f}x  identical greedy outputs (bf16): "
          f"{same}/{len(prompts)}, same first token: {first_same}/{len(prompts)}")
    return {"model": args.model_kind, "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "dtype": "bfloat16", "results": [ours, hf],
            "speedup_vs_hf": speedup, "identical_outputs_vs_hf": same,
            "same_first_token_vs_hf": first_same}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--layer-tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model-kind", choices=("deepseek_v3", "mixtral"), default="deepseek_v3")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    report = {"layer": {"num_experts": args.num_experts, "top_k": args.top_k, "hidden": args.hidden,
                        "moe_intermediate": args.moe_intermediate, "dtype": args.dtype,
                        "rows": bench_layer(args)},
              "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "platform": platform.platform(), "torch": torch.__version__}}
    if not args.skip_engine:
        report["engine"] = bench_engine(args)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
