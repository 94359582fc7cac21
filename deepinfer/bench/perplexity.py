"""`deepinfer bench perplexity FILE`: a model's perplexity on a text file through the engine's
prompt log-probs, optionally beside transformers' fp32 perplexity on the same windows.

The text is tokenized once and scored in sliding windows (the usual strided evaluation):
windows of `--context-len` tokens start every `--stride` (< context-len) tokens, and each
window scores only the tokens the previous window did not (the first window all but its first
token), so every token after the first is scored exactly once, with at least
context-len - stride tokens of left context after the first window. perplexity = exp(-mean log p(token | window before it)).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import dataclass

from deepinfer.bench.errors import BenchError
from deepinfer.engine.engine_args import add_engine_args, engine_config_from_args


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) of the text; its last `num_scored` tokens are scored."""

    begin: int
    end: int
    num_scored: int


def register(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text file (prompt log-probs)")
    p.add_argument("file", help="UTF-8 text file")
    p.add_argument("--context-len", type=int, default=512,
                   help="tokens per window (at most the model's context - 1)")
    p.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts (default: context-len / 2)")
    p.add_argument("--baseline", choices=("hf",), default=None,
                   help="also score the same windows with transformers in float32")
    p.add_argument("--json", dest="json_path", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)


def sliding_windows(num_tokens: int, context_len: int, stride: int) -> list[Window]:
    """Windows that together score tokens 1 .. num_tokens - 1 once each."""
    if context_len < 2 or not 1 <= stride < context_len:
        # Windows must overlap: a window's first token has no context inside it.
        raise BenchError("need --context-len >= 2 and 1 <= --stride < --context-len")
    if num_tokens < 2:
        raise BenchError("the text has fewer than 2 tokens: nothing to score")
    windows: list[Window] = []
    scored_until = 1  # token 0 is never scored: nothing predicts it
    begin = 0
    while scored_until < num_tokens:
        end = min(begin + context_len, num_tokens)
        windows.append(Window(begin, end, end - scored_until))
        scored_until = end
        begin += stride
    return windows


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read {path}: {e}") from None


def score_engine(llm, token_ids: list[int], windows: list[Window]) -> list[float]:
    """Per window, the sum of the scored tokens' log-probs (all windows in one batch)."""
    from deepinfer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": token_ids[w.begin:w.end]} for w in windows],
                           params, use_tqdm=False)
    sums = []
    for w, out in zip(windows, outputs):
        window_ids = token_ids[w.begin:w.end]
        first = len(window_ids) - w.num_scored
        sums.append(sum(out.prompt_logprobs[i][window_ids[i]].logprob
                        for i in range(first, len(window_ids))))
    return sums


def load_hf_model(model_path: str):
    """transformers' model of `model_path` (a GGUF file is dequantized) in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.float32}
    if model_path.endswith(".gguf"):
        kwargs["gguf_file"] = os.path.basename(model_path)
        model_path = os.path.dirname(model_path)
    return AutoModelForCausalLM.from_pretrained(model_path, **kwargs).eval()


def score_hf(model, token_ids: list[int], windows: list[Window]) -> list[float]:
    import torch

    sums = []
    with torch.inference_mode():
        for w in windows:
            ids = torch.tensor([token_ids[w.begin:w.end]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)  # [n - 1, V]
            targets = ids[0, 1:]
            picked = logp.gather(1, targets.unsqueeze(1)).squeeze(1)  # [n - 1]
            sums.append(float(picked[len(picked) - w.num_scored:].sum()))
    return sums


def summarize(name: str, sums: list[float], num_scored: int, elapsed: float) -> dict:
    nll = -sum(sums) / num_scored
    return {"name": name, "perplexity": math.exp(nll), "mean_nll": nll,
            "elapsed_s": elapsed, "scored_tokens_per_s": num_scored / elapsed}


def _prepare(args: argparse.Namespace, config):
    """(source, token ids, windows), every input checked before the engine is built."""
    from deepinfer.runtime.model_source import resolve_model

    stride = args.stride or max(1, args.context_len // 2)
    sliding_windows(2, args.context_len, stride)  # the numbers alone
    text = read_text(args.file)
    try:
        source = resolve_model(config.model)
        tokenizer = source.load_tokenizer()
    except (FileNotFoundError, OSError, ValueError) as e:
        raise BenchError(f"cannot load model: {e}") from None
    limit = min(config.max_model_len or source.config.max_position_embeddings,
                source.config.max_position_embeddings)
    if args.context_len >= limit:
        raise BenchError(f"--context-len {args.context_len} must be below the model's context "
                         f"length ({limit})")
    token_ids = list(tokenizer(text).input_ids)
    return source, tokenizer, token_ids, sliding_windows(len(token_ids), args.context_len, stride)


def run(args: argparse.Namespace) -> int:
    import torch

    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.llm import LLM

    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        raise BenchError(str(e)) from None
    source, tokenizer, token_ids, windows = _prepare(args, config)
    try:
        llm = LLM.from_engine(LLMEngine(config, source=source, tokenizer=tokenizer))
    except (FileNotFoundError, OSError, ValueError) as e:
        raise BenchError(f"cannot load model: {e}") from None
    if windows[0].end >= llm.engine.max_model_len:
        raise BenchError(f"--context-len {args.context_len} does not fit the KV cache "
                         f"({llm.engine.max_model_len} tokens): raise --kv-cache-memory")
    num_scored = sum(w.num_scored for w in windows)
    start = time.perf_counter()
    results = [summarize("deepinfer", score_engine(llm, token_ids, windows), num_scored,
                         time.perf_counter() - start)]
    if args.baseline == "hf":
        model = load_hf_model(source.path)
        start = time.perf_counter()
        results.append(summarize("hf-fp32", score_hf(model, token_ids, windows), num_scored,
                                 time.perf_counter() - start))
    report = {"file": args.file, "model": llm.engine.model_name, "dtype": config.dtype,
              "num_tokens": len(token_ids), "num_scored_tokens": num_scored,
              "num_windows": len(windows), "context_len": args.context_len,
              "stride": windows[1].begin if len(windows) > 1 else args.context_len,
              "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "platform": platform.platform(), "torch": torch.__version__},
              "results": results, "perplexity": results[0]["perplexity"]}
    for r in results:
        print(f"{r['name']:>10}: perplexity {r['perplexity']:.4f}  (mean NLL {r['mean_nll']:.5f},"
              f" {num_scored} tokens, {r['elapsed_s']:.1f} s)")
    if len(results) == 2:
        report["relative_difference_vs_hf"] = results[0]["perplexity"] / results[1]["perplexity"] - 1
        print(f"deepinfer vs hf-fp32: {100 * report['relative_difference_vs_hf']:+.3f}%")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0
