"""Batch-1 decode of a block-scaled FP8 checkpoint against its bf16 copy: a random
Qwen3-shaped dense model large enough that every decode step streams its weights from memory,
written in both layouts (tests/integration/fp8_checkpoints.py converts the bf16 one), loaded
into two engines in this process, decoded alternately.

    .venv/bin/python benchmarks/fp8_decode_bench.py --json benchmarks/results/fp8_decode.json

`--compare isa` decodes the FP8 checkpoint alone, switching its layers' verified quantized
kernel between instruction-set caps each round (`--isas portable,avx2`: the per-value loop AVX2
hosts ran for FP8 before the AVX2 kernel, then that kernel), with the bf16 copy beside them:

    .venv/bin/python benchmarks/fp8_decode_bench.py --compare isa --layers 4 --vocab 8192 \
        --tokens 16 --rounds 5 --json benchmarks/results/fp8_decode_isa.json

Default shape (Qwen3-0.6B's): hidden 1024, intermediate 3072, 28 layers, 16 query / 8 KV heads
of 128, vocabulary 32000 (smaller than Qwen3's own, so the head does not dominate): 0.44 B
parameters, 0.88 GB in bf16. Decode tok/s of one request = (tokens - 1) / (last - first token
time); best and median over `--rounds` alternating rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.integration helpers
from bench_report import BenchReport  # noqa: E402


def write_checkpoints(root: str, args) -> tuple[str, str]:
    """(fp8 dir, bf16 dir) of one random Qwen3 model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.integration.fp8_checkpoints import write_fp8_pair

    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.head_dim, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    fp8_dir, bf16_dir = os.path.join(root, "fp8"), os.path.join(root, "bf16")
    write_fp8_pair(model, fp8_dir, bf16_dir)
    model.save_pretrained(bf16_dir)  # the bf16 copy (write_fp8_pair left fp32 references)
    return fp8_dir, bf16_dir


def decode_rate(llm, prompt: list[int], num_tokens: int) -> float:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)


def kernel_switch(model, isa_name: str):
    """A callable that gives every quantized layer of `model` the verified kernel at `isa_name`."""
    from deepinfer.models.quantized_model import quantized_modules
    from deepinfer.runtime.cpu_quant_linear import ISA_CODES, _load

    kernel = _load(ISA_CODES[isa_name])
    assert kernel is not None and kernel.isa_name == isa_name, f"no verified {isa_name} kernel"
    modules = [m for m in quantized_modules(model) if getattr(m, "kernel", None) is not None]
    assert modules, "the FP8 layers have no kernel installed"

    def switch() -> None:
        for module in modules:
            module.kernel = kernel
    return switch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compare", choices=("bf16", "isa"), default="bf16")
    p.add_argument("--isas", default="portable,avx2", help="with --compare isa: kernel caps")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()

    from deepinfer import LLM
    from deepinfer.models.quantized_model import weight_bytes_by_format

    bench = BenchReport()
    with tempfile.TemporaryDirectory(prefix="fp8-bench-") as root:
        fp8_dir, bf16_dir = write_checkpoints(root, args)
        sizes = {k: sum(f.stat().st_size for f in Path(d).glob("*.safetensors"))
                 for k, d in (("fp8", fp8_dir), ("bf16", bf16_dir))}
        engines = {name: LLM(model=d, dtype="bfloat16", kv_cache_memory="256MiB", seed=0)
                   for name, d in (("bf16", bf16_dir), ("fp8", fp8_dir))}
        prompt = list(range(100, 116))
        # variant -> (engine, what to switch before decoding with it)
        variants = {"bf16": (engines["bf16"], lambda: None)}
        if args.compare == "isa":
            for isa in args.isas.split(","):
                variants[f"fp8_{isa}"] = (engines["fp8"], kernel_switch(engines["fp8"].engine.model, isa))
        else:
            variants["fp8"] = (engines["fp8"], lambda: None)
        for llm, switch in variants.values():
            switch()
            decode_rate(llm, prompt, 4)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (llm, switch) in variants.items():
                switch()
                rates[name].append(decode_rate(llm, prompt, args.tokens))
        resident = {name: weight_bytes_by_format(llm.engine.model) for name, llm in engines.items()}
    report = {"shape": vars(args), "checkpoint_bytes": sizes, "resident_weight_bytes": resident,
              "decode_tok_s": rates,
              "best": {k: max(v) for k, v in rates.items()},
              "median": {k: statistics.median(v) for k, v in rates.items()}}
    for name in variants:
        engine = "fp8" if name.startswith("fp8") else "bf16"
        report[f"{name}_over_bf16_median"] = report["median"][name] / report["median"]["bf16"]
        print(f"{name:>12}: decode {report['median'][name]:7.2f} tok/s median "
              f"(best {report['best'][name]:.2f}, {report[f'{name}_over_bf16_median']:.2f}x bf16), "
              f"checkpoint {sizes[engine] / 1e9:.3f} GB, resident {sum(resident[engine].values()) / 1e9:.3f} GB")
    fp8_names = [n for n in variants if n != "bf16"]
    if len(fp8_names) == 2:
        a, b = (report["median"][n] for n in fp8_names)
        report["after_over_before_median"] = b / a
        print(f"{fp8_names[1]} / {fp8_names[0]}: {b / a:.2f}x")
    bench.finish(report, args.json_path)


if __name__ == "__main__":
    main()
