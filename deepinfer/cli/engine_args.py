"""Engine flags shared by `serve`, `generate` and `bench offline`: one place to add a flag."""
from __future__ import annotations

import argparse

from deepinfer.arg_groups import group
from deepinfer.sampling_params import LOGPROBS_MODES


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the EngineConfig flags to `parser` (defaults: EngineConfig's own)."""
    g = group(parser, "model")
    g.add_argument("--model", default=None,
                   help="GGUF file, HF folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                   help="activation and (unquantized) weight dtype")
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
            seed=args.seed, served_model_name=args.served_model_name,
            speculative_config=getattr(args, "speculative_config", None),
            logprobs_mode=getattr(args, "logprobs_mode", LOGPROBS_MODES[0]))
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from None


def add_parallel_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Data-parallel attention / expert-parallel MoE flags (vLLM's names), for `serve`."""
    g = group(parser, "parallel")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine rank processes, each with its own scheduler and KV cache; the "
                        "front routes each request to the least loaded rank")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard the MoE experts over the ranks (they step in lockstep)")
    g.add_argument("--enable-eplb", action="store_true",
                   help="expert-parallel load balancer: replicate and move hot experts")
    g.add_argument("--eplb-config", default=None, metavar="JSON",
                   help='e.g. \'{"window_size": 1000, "step_interval": 3000, '
                        '"num_redundant_experts": 8}\'')
    g.add_argument("--all2all-backend", default="alltoall",
                   choices=("alltoall", "allgather_reducescatter"),
                   help="token dispatch/combine of expert-parallel MoE layers")
    g.add_argument("--ep-groups", type=int, default=1,
                   help="independent expert-parallel groups of --data-parallel-size ranks each; "
                        "a dead rank takes only its group out of routing")
    g.add_argument("--ep-collective-timeout", type=float, default=60.0,
                   help="seconds a rank waits in a collective before it fails (no hang)")
    return parser


def ep_config_from_args(args: argparse.Namespace, engine_config):
    """An EPConfig from the parallel flags; None for plain colocated serving. Bad values or a
    model that cannot run with them raise CLIError."""
    from deepinfer.cli.main import CLIError
    from deepinfer.ep.ep_config import EPConfig
    from deepinfer.moe.eplb_config import EPLBConfig

    try:
        if args.eplb_config is not None and not args.enable_eplb:
            raise ValueError("--eplb-config needs --enable-eplb")
        config = EPConfig(
            data_parallel_size=args.data_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel, num_groups=args.ep_groups,
            dispatcher=args.all2all_backend, enable_eplb=args.enable_eplb,
            eplb=EPLBConfig.from_json(args.eplb_config),
            collective_timeout_s=args.ep_collective_timeout)
        if not config.is_parallel:
            return None
        if config.enable_expert_parallel and engine_config.scheduler == "compute-aware" \
                and not engine_config.cost_profile:
            raise ValueError("--scheduler compute-aware with --enable-expert-parallel needs "
                             "--cost-profile (ranks cannot profile outside their lockstep)")
        from deepinfer.runtime.model_source import resolve_model
        config.check_model(resolve_model(engine_config.model).config)
        return config
    except (OSError, ValueError) as e:
        raise CLIError(str(e)) from None
