"""`deepinfer generate "prompt"`: one answer from the model (chat template unless --raw)."""
from __future__ import annotations

import argparse
import sys

from deepinfer.engine.engine_args import add_engine_args, engine_config_from_args


def register(sub) -> None:
    p = sub.add_parser("generate", help="answer one prompt")
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=run, kv_cache_memory="512MiB")


def run(args: argparse.Namespace) -> int:
    from deepinfer.cli.main import CLIError
    from deepinfer.sampling_params import SamplingParams

    try:
        config = engine_config_from_args(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        raise CLIError(str(e)) from None
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.llm import LLM

    try:
        llm = LLM.from_engine(LLMEngine(config))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise CLIError(f"cannot load model: {e}") from None
    try:
        if args.raw:
            out = llm.generate(args.prompt, params, use_tqdm=False)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            out = llm.chat(messages, params, use_tqdm=False)
    except ValueError as e:
        raise CLIError(str(e)) from None
    sys.stdout.write(out[0].outputs[0].text.strip() + "\n")
    return 0
