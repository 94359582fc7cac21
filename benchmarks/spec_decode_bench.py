"""Speculative decoding benchmark: per-request output speed with and without it.

Workloads on the default model:

* code (greedy): code-editing chat requests built from real functions of the Python standard
  library's own source files ("rewrite this function with `x` renamed to `y`", "add type
  hints"); the answer repeats most of its prompt, which prompt lookup (n-gram) exploits;
* random (seeded sampling, temperature 1): random-token prompts, where drafts are mostly
  rejected: what speculation costs when it does not pay. (Greedy continuations of random
  prompts fall into loops that prompt lookup predicts well, hence sampling.)

In bf16 some outputs differ from the plain engine's after a near-tie (verification runs a
chunk of 1 + k tokens, a decode one token: other kernels, other rounding); the plain engine
at batch 1 vs batch 16 is reported alongside as the same kind of numerical difference. In
fp32 the tests show the outputs equal token for token.

Each runs at batch 1 (requests one at a time, the speculative and the plain engine alternating
request by request, so drift of a shared machine hits both alike) and at batch 16 (all at
once). Reported per request: output tokens / (finish - first scheduled) ("tok/s"), and the
decode rate after the first token; per engine: mean acceptance length, acceptance rate, and
whether the outputs equal the plain engine's token for token.

    .venv/bin/python benchmarks/spec_decode_bench.py --json benchmarks/results/spec_decode_bench.json
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepinfer import LLM, SamplingParams  # noqa: E402

# Stdlib modules whose functions become editing tasks (pure-Python, stable, varied code).
STDLIB_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "posixpath", "string", "bisect",
                  "heapq", "difflib", "calendar", "colorsys", "html", "quopri", "base64",
                  "statistics", "fractions")


def stdlib_functions(min_lines: int, max_lines: int) -> list[tuple[str, str, list[str]]]:
    """(module, function source, its argument names) for top-level functions of
    STDLIB_MODULES with min_lines..max_lines lines and at least one named argument."""
    import importlib

    out = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        source = inspect.getsource(module)
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            n = node.end_lineno - node.lineno + 1
            args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            if min_lines <= n <= max_lines and args and not node.decorator_list:
                out.append((name, "\n".join(lines[node.lineno - 1:node.end_lineno]), args))
    return out


def code_tasks(num: int, seed: int, min_lines: int, max_lines: int) -> list[list[dict]]:
    """Chat conversations: alternately a rename and a type-hint request on a stdlib function."""
    rng = random.Random(seed)
    functions = stdlib_functions(min_lines, max_lines)
    rng.shuffle(functions)
    tasks = []
    for i, (module, source, args) in enumerate(functions[:num]):
        if i % 2 == 0:
            old = rng.choice(args)
            ask = (f"Rewrite this function from Python's `{module}` module with the variable "
                   f"`{old}` renamed to `{old}_value`. Reply with the complete code only.")
        else:
            ask = (f"Add type hints to this function from Python's `{module}` module. Reply "
                   f"with the complete code only.")
        tasks.append([{"role": "user", "content": f"{ask}\n\n```python\n{source}\n```"}])
    return tasks


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]}
            for _ in range(num)]


def run(llm: LLM, prompts: list, params: SamplingParams, chat: bool):
    if chat:
        return llm.chat(prompts, params, use_tqdm=False)
    return llm.generate(prompts, params, use_tqdm=False)


def request_rates(outputs) -> list[dict]:
    rows = []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        total = m.finished_time - m.first_scheduled_time
        decode = m.last_token_time - m.first_token_time
        rows.append({"output_tokens": n, "tok_s": n / total,
                     "decode_tok_s": (n - 1) / decode if n > 1 and decode > 0 else None})
    return rows


def summary(rows: list[dict]) -> dict:
    decode = [r["decode_tok_s"] for r in rows if r["decode_tok_s"]]
    return {"num_requests": len(rows), "output_tokens": sum(r["output_tokens"] for r in rows),
            "mean_tok_s": statistics.fmean(r["tok_s"] for r in rows),
            "median_tok_s": statistics.median(r["tok_s"] for r in rows),
            "mean_decode_tok_s": statistics.fmean(decode) if decode else None}


# ---- shared with spec_vs_vllm.py: the workload flags, the alternating timing loop, counters

SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens")  # vLLM's names, without its prefix


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The code-editing workload's flags (both benchmarks build it with `code_tasks`)."""
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--min-lines", type=int, default=8)
    parser.add_argument("--max-lines", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)


def alternate(engines: dict, num_items: int, batch: int, on_batch=None) -> dict[str, list]:
    """Runs items [i, i + batch) on every engine in turn (`engines[name](start, stop)` returns
    that slice's results), batch after batch: the engines alternate, so drift of a shared
    machine hits them alike. `on_batch(start, results)` reports progress."""
    results: dict[str, list] = {name: [] for name in engines}
    for start in range(0, num_items, batch):
        stop = min(start + batch, num_items)
        for name, run_slice in engines.items():
            results[name] += run_slice(start, stop)
        if on_batch is not None:
            on_batch(start, results)
    return results


def acceptance(before: dict, after: dict) -> dict:
    """Drafts, accepted tokens, mean acceptance length and acceptance rate between two
    snapshots of the spec-decode counters ({} where an engine has none)."""
    if not all(k in after for k in SPEC_COUNTERS):
        return {}
    drafts, draft_tokens, accepted = (after[k] - before.get(k, 0) for k in SPEC_COUNTERS)
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None}


def spec_counters(llm: LLM) -> dict:
    s = llm.engine.get_stats()
    return {k: getattr(s, k) for k in SPEC_COUNTERS}


def measure(base: LLM, spec: LLM, prompts: list, params: SamplingParams | list, chat: bool,
            batch: int) -> tuple[dict, list[list[int]]]:
    before = spec_counters(spec)
    if not isinstance(params, list):
        params = [params] * len(prompts)
    out = alternate({"plain": lambda a, b: run(base, prompts[a:b], params[a:b], chat),
                     "speculative": lambda a, b: run(spec, prompts[a:b], params[a:b], chat)},
                    len(prompts), batch)
    base_out, spec_out = out["plain"], out["speculative"]
    plain, fast = summary(request_rates(base_out)), summary(request_rates(spec_out))
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(base_out, spec_out))
    return {
        "batch": batch, "plain": plain, "speculative": fast,
        "speedup_mean_tok_s": fast["mean_tok_s"] / plain["mean_tok_s"],
        **acceptance(before, spec_counters(spec)),
        "outputs_equal": f"{same}/{len(base_out)}",
    }, [o.outputs[0].token_ids for o in base_out]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--speculative-config", default=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}))
    parser.add_argument("--num-code-batch1", type=int, default=8)
    parser.add_argument("--num-random-batch1", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--random-prompt-len", type=int, default=256)
    parser.add_argument("--cases", nargs="+", default=None,
                        help="run only these (code_batch1 code_batch16 random_batch1 random_batch16); "
                             "default: all")
    add_workload_args(parser)
    args = parser.parse_args()

    spec_config = json.loads(args.speculative_config)
    common = dict(dtype=args.dtype, kv_cache_memory="1GiB", num_threads=args.threads, seed=0)
    base = LLM(args.model, **common)
    spec = LLM(args.model, share_weights_with=base, speculative_config=spec_config, **common)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    random_params = [SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=args.max_tokens,
                                    ignore_eos=True) for i in range(max(args.num_random_batch1,
                                                                        args.batch))]
    num_code = max(args.num_code_batch1, args.batch)
    code = code_tasks(num_code, args.seed, args.min_lines, args.max_lines)
    vocab = base.engine.model_config.vocab_size
    rand = random_prompts(max(args.num_random_batch1, args.batch), args.random_prompt_len, vocab,
                          args.seed)
    run(base, code[:1], params, chat=True)  # warm-up both engines
    run(spec, code[:1], params, chat=True)

    results = {}
    for label, prompts, p, chat, n1 in (("code", code, params, True, args.num_code_batch1),
                                        ("random", rand, random_params, False,
                                         args.num_random_batch1)):
        plain_tokens = {}
        for batch, n in ((1, n1), (args.batch, args.batch)):
            if args.cases is not None and f"{label}_batch{batch}" not in args.cases:
                continue
            start = time.perf_counter()
            r, plain_tokens[batch] = measure(base, spec, prompts[:n],
                                             p if not isinstance(p, list) else p[:n], chat, batch)
            r["wall_s"] = time.perf_counter() - start
            if batch != 1 and 1 in plain_tokens:  # numerics alone: the plain engine, batch 1 against this batch
                same = sum(a == b for a, b in zip(plain_tokens[1], plain_tokens[batch]))
                r["plain_batch1_vs_this_batch_equal"] = f"{same}/{min(n1, n)}"
            results[f"{label}_batch{batch}"] = r
            print(f"{label:6s} batch {batch:2d}: plain {r['plain']['mean_tok_s']:6.1f} tok/s, "
                  f"speculative {r['speculative']['mean_tok_s']:6.1f} tok/s "
                  f"({r['speedup_mean_tok_s']:.2f}x), acceptance length "
                  f"{r['mean_acceptance_length'] or 0:.2f}, equal outputs {r['outputs_equal']}",
                  flush=True)
    report = {
        "benchmark": "spec_decode_bench", "command": " ".join(sys.argv),
        "model": base.engine.model_name, "dtype": args.dtype, "threads": args.threads,
        "speculative_config": spec_config, "max_tokens": args.max_tokens,
        "stdlib_modules": list(STDLIB_MODULES), "host": platform.node(),
        "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
        "results": results,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
