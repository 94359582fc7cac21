"""Data-parallel / expert-parallel flags of `serve` (vLLM's names), next to the EP code like the
other flag modules; bad values raise ValueError with a one-line message (the CLI's exit 2)."""
from __future__ import annotations

import argparse

from deepinfer.arg_groups import group


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
    model that cannot run with them raise ValueError (one line)."""
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
    except OSError as e:
        raise ValueError(str(e)) from None
