"""`deepinfer bench offline`: throughput of the offline engine on random-token prompts,
optionally against Hugging Face transformers' batched generate on the identical workload."""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

from deepinfer.bench.errors import BenchError
from deepinfer.engine.engine_args import add_engine_args, engine_config_from_args


def register(sub) -> None:
    p = sub.add_parser("offline", help="offline throughput (random prompts, greedy, ignore EOS)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--baseline", choices=("hf",), default=None,
                   help="also run transformers' generate on the same workload")
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: all prompts at once")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--profile", dest="profile_dir", default=None, metavar="DIR",
                   help="torch.profiler traces of the first prefill step and of decode steps "
                        "after warm-up into DIR (Chrome trace + op table); prints the top ops")
    p.add_argument("--profile-decode-steps", type=int, default=8,
                   help="decode steps to record with --profile (after 4 warm-up decode steps)")
    add_engine_args(p)
    p.set_defaults(func=run)


def make_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids where small vocabularies keep their special tokens.
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(num)]


def run_engine(config, prompts: list[list[int]], output_len: int, trace=None) -> dict:
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM.from_engine(LLMEngine(config))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:16]} for p in prompts[:2]],
                 SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    runner = llm.engine.runner
    if trace is not None:  # wraps the instance's execute for the measured run only
        runner.execute = trace.wrap(runner.execute)
    try:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        if trace is not None:
            del runner.execute
            trace.close()
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return _rates("deepinfer", elapsed, sum(map(len, prompts)), num_out,
                  [o.outputs[0].token_ids for o in outs])


def run_hf(config, prompts: list[list[int]], output_len: int, batch_size: int | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from deepinfer.runtime.model_source import resolve_model

    source = resolve_model(config.model)
    kwargs = {"dtype": getattr(torch, config.dtype)}
    if source.path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path),
                                                     gguf_file=os.path.basename(source.path), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, **kwargs)
    model.eval()
    batch_size = batch_size or len(prompts)
    gen = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
               pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]]), do_sample=False, max_new_tokens=4,
                       pad_token_id=0)  # warm-up
        start = time.perf_counter()
        outputs = []
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i:i + batch_size])  # equal lengths: no padding
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **gen)
            outputs.extend(out[:, batch.shape[1]:].tolist())
        elapsed = time.perf_counter() - start
    return _rates("hf", elapsed, sum(map(len, prompts)), sum(map(len, outputs)), outputs)


def _step_trace(args: argparse.Namespace, config):
    """A StepTrace for --profile (None without it); bad values are the CLI's one-line exit."""
    if args.profile_dir is None:
        return None
    if args.profile_decode_steps < 1:
        raise BenchError("--profile-decode-steps must be positive")
    if os.path.exists(args.profile_dir) and not os.path.isdir(args.profile_dir):
        raise BenchError(f"--profile {args.profile_dir}: exists and is not a directory")
    from deepinfer.engine.llm_engine import resolve_device
    from deepinfer.runtime.step_trace import StepTrace
    return StepTrace(args.profile_dir, decode_steps=args.profile_decode_steps,
                     device=resolve_device(config.device))


def _print_profile(trace) -> dict:
    from deepinfer.runtime.step_trace import format_top_ops
    windows = trace.close()
    if not windows:
        print("profile: no step was recorded")
    for w in windows:
        print(format_top_ops(w))
        if trace.on_cuda:
            print(format_top_ops(w, by="self_device_us"))
    if windows:
        print("(timings include the profiler's overhead; the self time of deepinfer_step[...] is "
              "work outside torch ops: Python, and C kernels called through ctypes)")
    return {w.name: {"trace": w.trace_path, "ops": w.ops_path, "num_steps": w.num_recorded,
                     "batch_sizes": w.batch_sizes} for w in windows}


def _rates(name: str, elapsed: float, num_in: int, num_out: int, token_ids) -> dict:
    return {"name": name, "elapsed_s": elapsed, "num_input_tokens": num_in,
            "num_output_tokens": num_out, "output_tokens_per_s": num_out / elapsed,
            "total_tokens_per_s": (num_in + num_out) / elapsed, "_token_ids": token_ids}


def run(args: argparse.Namespace) -> int:
    import torch

    from deepinfer.runtime.model_source import resolve_model

    if min(args.num_prompts, args.input_len, args.output_len) < 1:
        raise BenchError("--num-prompts, --input-len and --output-len must be positive")
    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        raise BenchError(str(e)) from None
    trace = _step_trace(args, config)
    try:
        vocab = resolve_model(config.model).config.vocab_size
    except (FileNotFoundError, ValueError, OSError) as e:
        raise BenchError(f"cannot load model: {e}") from None
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    results = [run_engine(config, prompts, args.output_len, trace)]
    if args.baseline == "hf":
        results.append(run_hf(config, prompts, args.output_len, args.hf_batch_size))
    report = {"workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "dtype": config.dtype, "seed": args.seed},
              "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "platform": platform.platform(), "torch": torch.__version__}}
    for r in results:
        print(f"{r['name']:>10}: {r['elapsed_s']:8.2f} s  output {r['output_tokens_per_s']:8.1f} tok/s"
              f"  total {r['total_tokens_per_s']:8.1f} tok/s")
    if len(results) == 2:
        ours, hf = results
        ratio = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
        same = sum(a == b for a, b in zip(ours["_token_ids"], hf["_token_ids"]))
        print(f"speed-up vs hf: {ratio:.2f}x   identical greedy outputs: {same}/{len(prompts)}")
        report["speedup_vs_hf"] = ratio
        report["identical_outputs_vs_hf"] = same
    if trace is not None:
        report["profile"] = _print_profile(trace)
    for r in results:
        r.pop("_token_ids")
    report["results"] = results
    report.update({k: v for k, v in results[0].items() if k != "name"})
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0
