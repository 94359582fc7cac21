"""Decode of a random Qwen3-MoE-shaped model with the routed experts on the torch path vs the
C decode kernel (runtime/cpu_moe_kernel.py), in one engine, alternating the two every round.

    .venv/bin/python benchmarks/moe_decode_bench.py > benchmarks/results/moe_decode.json

Default shape: 64 experts, top-8 (softmax, renormalised), hidden 1024, moe_intermediate 512,
4 layers, 8 query / 2 KV heads of 128, vocabulary 4096 (so the head does not dominate): each
decoded token reads 8 x 3 MiB of expert weights per layer. Reported per path: engine decode
tok/s at each `--batches` size (generated tokens after the first over the decode span, best
and median over `--rounds`), the process CPU time per token of the same runs' decode-only
steps (on a shared box it moves far less than wall time), and one layer's
routed-experts call alone at each `--layer-tokens` count (median wall and CPU microseconds on
random routing). JSON on stdout, a summary on stderr.
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


class DecodeCpuMeter:
    """Wraps the runner's `execute`: process CPU seconds and tokens of decode-only steps (one
    new token per scheduled request), so the prompts' prefill is left out."""

    def __init__(self, runner) -> None:
        self.cpu_s, self.num_tokens = 0.0, 0
        self._execute = runner.execute
        runner.execute = self.execute

    def execute(self, output):
        start = time.process_time()
        result = self._execute(output)
        if output.scheduled and output.num_batched_tokens == len(output.scheduled):
            self.cpu_s += time.process_time() - start
            self.num_tokens += output.num_batched_tokens
        return result


def decode_rate(llm, meter: DecodeCpuMeter, batch: int, num_tokens: int) -> tuple[float, float]:
    """(aggregate decode tok/s, process CPU ms per token of the decode-only steps) of `batch`
    concurrent greedy requests."""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 116 + 7 * i))} for i in range(batch)]
    meter.cpu_s, meter.num_tokens = 0.0, 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return (generated - batch) / (last - first), meter.cpu_s * 1e3 / max(meter.num_tokens, 1)


def layer_call_us(experts, num_tokens: int, top_k: int, repeats: int) -> tuple[float, float]:
    """Median (wall, process CPU) microseconds of one routed-experts call, random routing."""
    gen = torch.Generator().manual_seed(num_tokens)
    hidden = experts.gate_up_proj.shape[2]
    walls, cpus = [], []
    for _ in range(repeats):
        x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
        logits = torch.randn(num_tokens, experts.num_experts, generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
        start, cpu_start = time.perf_counter(), time.process_time()
        experts(x, weights, ids)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)
    return statistics.median(walls) * 1e6, statistics.median(cpus) * 1e6


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
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--layer-tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64])
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
    meter = DecodeCpuMeter(llm.engine.runner)

    def use(path: str) -> None:
        for layer in layers:
            layer.kernel = paths[path]

    for path in paths:  # warm-up
        use(path)
        decode_rate(llm, meter, 1, 4)
    batches, layer_tokens = args.batches, args.layer_tokens
    rates = {f"{path}_batch{b}": [] for path in paths for b in batches}
    cpu_ms = {f"{path}_batch{b}": [] for path in paths for b in batches}
    layer_us = {f"{path}_T{t}": [] for path in paths for t in layer_tokens}
    layer_cpu_us = {f"{path}_T{t}": [] for path in paths for t in layer_tokens}
    for _ in range(args.rounds):
        for path in paths:
            use(path)
            for batch in batches:
                rate, cpu = decode_rate(llm, meter, batch, args.tokens)
                rates[f"{path}_batch{batch}"].append(rate)
                cpu_ms[f"{path}_batch{batch}"].append(cpu)
            for num_tokens in layer_tokens:
                wall, cpu = layer_call_us(layers[0], num_tokens, args.top_k, args.layer_repeats)
                layer_us[f"{path}_T{num_tokens}"].append(wall)
                layer_cpu_us[f"{path}_T{num_tokens}"].append(cpu)
    median = {k: statistics.median(v) for k, v in rates.items()}
    cpu_median = {k: statistics.median(v) for k, v in cpu_ms.items()}
    report = {
        "shape": vars(args), "kernel_isa": kernel.isa_name, "kernel_max_tokens": kernel.max_tokens,
        "decode_tok_s": rates, "decode_tok_s_best": {k: max(v) for k, v in rates.items()},
        "decode_tok_s_median": median,
        "kernel_over_torch_median": {f"batch{b}": median[f"kernel_batch{b}"] / median[f"torch_batch{b}"]
                                     for b in batches},
        "cpu_ms_per_token": cpu_ms, "cpu_ms_per_token_median": cpu_median,
        "torch_over_kernel_cpu_median": {
            f"batch{b}": cpu_median[f"torch_batch{b}"] / cpu_median[f"kernel_batch{b}"] for b in batches},
        "layer_experts_us_median": {k: statistics.median(v) for k, v in layer_us.items()},
        "layer_experts_cpu_us_median": {k: statistics.median(v) for k, v in layer_cpu_us.items()},
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    for b in batches:
        print(f"batch {b}: torch {median[f'torch_batch{b}']:.2f} tok/s, kernel "
              f"{median[f'kernel_batch{b}']:.2f} tok/s ({report['kernel_over_torch_median'][f'batch{b}']:.2f}x); "
              f"CPU ms/token torch {cpu_median[f'torch_batch{b}']:.1f}, kernel "
              f"{cpu_median[f'kernel_batch{b}']:.1f}", file=sys.stderr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
