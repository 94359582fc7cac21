"""Engine flags shared by `serve`, `generate` and `bench offline`: one place to add a flag."""
from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the EngineConfig flags to `parser` (defaults: EngineConfig's own)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file, HF folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--kv-cache-memory", default="4GiB",
                   help="memory for KV blocks, e.g. 512MiB, 4GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact number of KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--threads", dest="num_threads", type=int, default=None,
                   help="CPU intra-op threads (default: all cores)")
    g.add_argument("--scheduler", default="token-budget",
                   choices=("token-budget", "compute-aware"))
    g.add_argument("--step-time-budget-ms", type=float, default=None,
                   help="per-step time budget of the compute-aware scheduler")
    g.add_argument("--cost-profile", default=None, help="cost-model profile JSON")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--served-model-name", default=None,
                   help="model name reported by the API (default: the model's own)")
    return parser


def engine_config_from_args(args: argparse.Namespace):
    """An EngineConfig from parsed flags; a bad combination raises CLIError (one line, exit 2)."""
    from deepinfer.cli.main import CLIError
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
            seed=args.seed, served_model_name=args.served_model_name)
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from None
