"""End-to-end A/B of two builds of kernels/quant_linear.c on the default model (its Q4_1
linears, Q8_0 head): this checkout's kernel against another kernels/ directory's (e.g. main's),
swapped call target by call target in one engine and alternated run by run, so both see the
same model, prompts and box. Prints numbers, asserts nothing but equal outputs.

    PYTHONPATH=. .venv/bin/python benchmarks/quant_kernel_ab.py --ab /work/main/deepinfer/runtime/kernels

Workloads: one prompt of --prefill tokens (max_tokens=1: prefill, M = the prompt per linear)
and --batch prompts of --batch-in tokens with --batch-out output tokens (a small W1: its
prefill, then batched decode steps of --batch rows, both on the prefill tiles). Median of
--reps runs per kernel: wall time and this process's CPU time (all threads; on a shared box the
CPU time moves less with other jobs). Greedy outputs of the two kernels must be equal (the
kernels compute the same bits).
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import time
from pathlib import Path

import torch

from deepinfer.llm import LLM
from deepinfer.runtime.cpu_kernel_build import _build
from deepinfer.runtime.cpu_quant_linear import load_quant_linear
from deepinfer.sampling_params import SamplingParams
from tests.integration.prompt_corpus import PARAGRAPHS


def other_entry(kernel_dir: Path):
    compiler = shutil.which("gcc") or shutil.which("cc")
    lib = ctypes.CDLL(str(_build(kernel_dir / "quant_linear.c", compiler)))
    return lib.quant_linear


def run(llm: LLM, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return (time.perf_counter() - t0, time.process_time() - c0,
            [list(o.outputs[0].token_ids) for o in outs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ab", type=Path, required=True, help="the other kernels/ directory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-in", type=int, default=64)
    ap.add_argument("--batch-out", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(dtype="bfloat16", num_threads=args.threads, seed=0, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, args.prefill))
    kernel = load_quant_linear()
    assert kernel is not None, "the quantized kernel is off on this host"
    other = other_entry(args.ab)
    other.argtypes, other.restype = kernel._fn.argtypes, kernel._fn.restype
    entries = {"other": other, "this": kernel._fn}
    ids = llm.get_tokenizer().encode(" ".join(PARAGRAPHS * 40))
    assert len(ids) >= args.prefill + args.batch * args.batch_in, "the corpus is too short"
    loads = {"prefill": ([ids[:args.prefill]], 1),
             "batch": ([ids[args.prefill + i * args.batch_in:][:args.batch_in]
                        for i in range(args.batch)], args.batch_out)}
    print(f"threads={args.threads} reps={args.reps} loadavg {open('/proc/loadavg').read().split()[:3]}")
    try:
        with torch.inference_mode():
            for name, (prompts, max_tokens) in loads.items():
                wall = {k: [] for k in entries}
                cpu = {k: [] for k in entries}
                tokens = {}
                for rep in range(args.reps + 1):  # the first round warms up
                    for key, fn in entries.items():
                        kernel._fn = fn
                        w, c, toks = run(llm, prompts, max_tokens)
                        tokens.setdefault(key, toks)
                        if rep:
                            wall[key].append(w)
                            cpu[key].append(c)
                med = {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in entries}
                same = tokens["other"] == tokens["this"]
                print(f"{name}: " + "  ".join(f"{k} wall {w:.3f} s cpu {c:.3f} s"
                                               for k, (w, c) in med.items())
                      + f"  other/this wall {med['other'][0] / med['this'][0]:.3f}"
                      f" cpu {med['other'][1] / med['this'][1]:.3f}"
                      + ("" if same else "  OUTPUTS DIFFER"), flush=True)
                print(f"  runs wall {wall}  cpu {cpu}", flush=True)
    finally:
        kernel._fn = entries["this"]
    print(f"loadavg at end {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
