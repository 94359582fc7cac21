"""Which path each native CPU kernel takes on this host: every kernel's load-time self-test
against torch is run (the same verdicts the engine acts on) and the instruction set it
computes with is printed, so a kernel that is silently off or on its portable path shows.

    .venv/bin/python benchmarks/cpu_kernel_paths.py --json benchmarks/results/cpu_kernel_paths.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer.runtime.cpu_kernel_build import cpu_identity, load_kernel_library


def quantized_gemv() -> dict:
    from deepinfer.runtime.cpu_quant_linear import (ISA_CODES, QuantLinearKernel, load_quant_linear,
                                                    quant_linear_mismatch)

    lib = load_kernel_library("quant_linear")
    if lib is None:
        return {"available": False}
    out: dict = {"per_isa": {}}
    for name, code in ISA_CODES.items():
        kernel = QuantLinearKernel(lib, code)
        if kernel.isa != code:
            out["per_isa"][name] = "not in this build"
            continue
        with torch.inference_mode():
            problem = quant_linear_mismatch(kernel)
        out["per_isa"][name] = "self-test passes" if problem is None else f"fails: {problem}"
    picked = load_quant_linear()
    out["picked"] = None if picked is None else picked.isa_name
    return out


def other_kernels() -> dict:
    from deepinfer.runtime.cpu_decode_kernel import load_decode_kernel
    from deepinfer.runtime.cpu_decode_stack import load_decode_stack_library
    from deepinfer.runtime.cpu_prefill_kernel import load_prefill_kernel
    from deepinfer.runtime.cpu_small_batch_linear import load_small_batch_linear

    flags = next((line.split(":", 1)[1].split() for line in cpu_identity().splitlines()
                  if line.split(":")[0].strip() == "flags"), [])
    generic = ("AVX-512" if "avx512f" in flags else "AVX2 + FMA" if {"avx2", "fma"} <= set(flags)
               else "generic C (no AVX-512 or AVX2 in this build)")
    decode = load_decode_kernel()
    stack = load_decode_stack_library()
    return {
        "small_batch_linear (bf16 GEMV)": "verified, " + generic if load_small_batch_linear() else "off",
        "paged_decode_attention": "off" if decode is None
        else f"verified, {generic}, dtypes {sorted(str(d) for d in decode._fns)}",
        "prefill_attention": "verified" if load_prefill_kernel() else "off (needs AVX-512 BF16): SDPA",
        "decode_stack": "verified" if stack is not None else "off (needs AVX-512 or AVX2 + FMA): per-op path",
        "onednn_bf16_packing": _onednn_packs(),
    }


def _onednn_packs() -> str:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 64)
        return "available"
    except (RuntimeError, AttributeError) as e:
        return f"off ({str(e).splitlines()[0][:120]})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = {"cpu": cpu_identity().splitlines()[:4], "quantized_gemv": quantized_gemv(),
              **other_kernels(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps({k: v for k, v in report.items() if k != "cpu"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
