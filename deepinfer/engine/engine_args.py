"""Engine flags shared by `serve`, `generate` and `bench offline`: one place to add a flag.

Next to the engine like the other flag modules; bad values raise ValueError with a one-line
message, which the CLI turns into its exit 2."""
from __future__ import annotations

import argparse

from deepinfer.arg_groups import group
from deepinfer.quant.quantization_mode import QUANTIZATION_CHOICES
from deepinfer.sampling_params import LOGPROBS_MODES


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the EngineConfig flags to `parser` (defaults: EngineConfig's own)."""
    g = group(parser, "model")
    g.add_argument("--model", default=None,
                   help="GGUF file, HF folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                   help="activation and (unquantized) weight dtype")
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                   help="weight format, as vLLM: default the checkpoint's own (a GGUF file's "
                        "quantized blocks computed natively on CPU, an FP8 checkpoint's "
                        "block-scaled FP8); none | bf16 expand every weight to --dtype; gguf; "
                        "int8 quantizes bf16/fp32 weights at load (per-channel weights, "
                        "per-token activations); fp8")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--seed", type=int, default=0,
                   help="engine seed (requests without their own seed draw from it)")
    g.add_argument("--served-model-name", default=None,
                   help="model name reported by the API (default: the model's own)")
    g.add_argument("--threads", dest="num_threads", type=int, default=None,
                   help="CPU intra-op threads (default: all cores)")
    g = group(parser, "kv-cache")
    g.add_argument("--kv-cache-memory", default="4GiB",
                   help="memory for KV blocks, e.g. 512MiB, 4GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact number of KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV blocks of earlier prompts' common prefixes")
    g = group(parser, "scheduling")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most requests running in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens in one step (prefill chunks + decodes; token-budget "
                        "scheduler)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's context length)")
    g.add_argument("--scheduler", default="token-budget",
                   choices=("token-budget", "compute-aware"),
                   help="fixed token budget per step, or chunks sized so each step's predicted "
                        "time fits --step-time-budget-ms")
    g.add_argument("--step-time-budget-ms", type=float, default=None,
                   help="per-step time budget of the compute-aware scheduler")
    g.add_argument("--cost-profile", default=None, help="cost-model profile JSON")
    g = group(parser, "speculative")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'; methods '
                        'ngram | draft_model (with "model") | mtp (DeepSeek-V3)')
    g = group(parser, "outputs")
    g.add_argument("--logprobs-mode", default=LOGPROBS_MODES[0], choices=LOGPROBS_MODES,
                   help="what logprobs report, as vLLM: the model's raw output (default) or "
                        "after the request's penalties / bias / masks / temperature / top-k/p")
    return parser


def engine_config_from_args(args: argparse.Namespace):
    """An EngineConfig from parsed flags; a bad combination raises ValueError (one line)."""
    from deepinfer.engine.engine_config import EngineConfig
    from deepinfer.runtime.kv_cache import parse_memory

    try:
        parse_memory(args.kv_cache_memory)  # fail here, not seconds later in the engine
        return EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device,
            kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
            num_threads=args.num_threads, scheduler=args.scheduler,
            step_time_budget_ms=args.step_time_budget_ms, cost_profile=args.cost_profile,
            seed=args.seed, served_model_name=args.served_model_name,
            speculative_config=getattr(args, "speculative_config", None),
            logprobs_mode=getattr(args, "logprobs_mode", LOGPROBS_MODES[0]),
            quantization=getattr(args, "quantization", None))
    except TypeError as e:
        raise ValueError(str(e)) from None
