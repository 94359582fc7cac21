"""Decode of a random Qwen3-MoE-shaped model with the routed experts on the torch path vs the
C decode kernel (runtime/cpu_moe_kernel.py), in one engine, alternating the two every round.

    .venv/bin/python benchmarks/moe_decode_bench.py > benchmarks/results/moe_decode.json

Default shape: 64 experts, top-8 (softmax, renormalised), hidden 1024, moe_intermediate 512,
4 layers, 8 query / 2 KV heads of 128, vocabulary 4096 (so the head does not dominate): each
decoded token reads 8 x 3 MiB of expert weights per layer. Reported per path: engine decode
tok/s at batch 1 and 8 (generated tokens after the first over the decode span, best and
median over `--rounds`), and one layer's routed-experts call alone (median microseconds at
1 and 8 tokens on random routing). JSON on stdout, a summary on stderr.
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


def write_checkpoint(root: str, args) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                            intermediate_size=4 * args.hidden, moe_intermediate_size=args.moe_inter,
                            num_experts=args.experts, num_experts_per_tok=args.top_k,
                            norm_topk_prob=True, num_hidden_layers=args.layers,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                            max_position_embeddings=4096, tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(root)
    return root


def decode_rate(llm, batch: int, num_tokens: int) -> float:
    """Aggregate decode tok/s of `batch` concurrent greedy requests."""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 116 + 7 * i))} for i in range(batch)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first)


def layer_call_us(experts, num_tokens: int, top_k: int, repeats: int) -> float:
    """Median microseconds of one routed-experts call on random routing."""
    gen = torch.Generator().manual_seed(num_tokens)
    hidden = experts.gate_up_proj.shape[2]
    times = []
    for _ in range(repeats):
        x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
        logits = torch.randn(num_tokens, experts.num_experts, generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
        start = time.perf_counter()
        experts(x, weights, ids)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-inter", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layer-repeats", type=int, default=30)
    args = p.parse_args()

    from deepinfer import LLM
    from deepinfer.moe.layer import MoEExperts
    from deepinfer.runtime.cpu_moe_kernel import load_moe_kernel

    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as root:
        llm = LLM(model=write_checkpoint(root, args), dtype="bfloat16",
                  kv_cache_memory="256MiB", seed=0)
    kernel = load_moe_kernel(quantized=False)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, MoEExperts)]
    assert kernel is not None and layers and all(m.kernel is kernel for m in layers), \
        "the MoE kernel is not installed (see the self-test warning)"
    paths = {"torch": None, "kernel": kernel}

    def use(path: str) -> None:
        for layer in layers:
            layer.kernel = paths[path]

    for path in paths:  # warm-up
        use(path)
        decode_rate(llm, 1, 4)
    rates = {f"{path}_batch{b}": [] for path in paths for b in (1, 8)}
    layer_us = {f"{path}_T{t}": [] for path in paths for t in (1, 8)}
    for _ in range(args.rounds):
        for path in paths:
            use(path)
            for batch in (1, 8):
                rates[f"{path}_batch{batch}"].append(decode_rate(llm, batch, args.tokens))
            for num_tokens in (1, 8):
                layer_us[f"{path}_T{num_tokens}"].append(
                    layer_call_us(layers[0], num_tokens, args.top_k, args.layer_repeats))
    median = {k: statistics.median(v) for k, v in rates.items()}
    report = {
        "shape": vars(args), "kernel_isa": kernel.isa_name,
        "decode_tok_s": rates, "decode_tok_s_best": {k: max(v) for k, v in rates.items()},
        "decode_tok_s_median": median,
        "kernel_over_torch_median": {f"batch{b}": median[f"kernel_batch{b}"] / median[f"torch_batch{b}"]
                                     for b in (1, 8)},
        "layer_experts_us_median": {k: statistics.median(v) for k, v in layer_us.items()},
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    for b in (1, 8):
        print(f"batch {b}: torch {median[f'torch_batch{b}']:.2f} tok/s, kernel "
              f"{median[f'kernel_batch{b}']:.2f} tok/s ({report['kernel_over_torch_median'][f'batch{b}']:.2f}x)",
              file=sys.stderr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
