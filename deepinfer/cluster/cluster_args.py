"""`deepinfer serve` flags of disaggregated serving, and the client they select.

Bad flags raise ValueError with a one-line message; the CLI turns it into its exit-2 error."""
from __future__ import annotations

import argparse

from deepinfer.arg_groups import group
from deepinfer.kvstore import STORE_URL_HELP
from deepinfer.routing import (DEFAULT_DECODE_POLICY, DEFAULT_PREFILL_POLICY, DECODE_POLICIES,
                               PREFILL_POLICIES)


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    g = group(parser, "disaggregation")
    g.add_argument("--prefill-workers", type=int, default=None,
                   help="prefill worker processes (with --decode-workers: disaggregated)")
    g.add_argument("--decode-workers", type=int, default=None, help="decode worker processes")
    g.add_argument("--decode-data-parallel-size", type=int, default=1, metavar="N",
                   help="rank processes per decode worker, each with its own KV cache and seen "
                        "by the decode router; with --enable-expert-parallel a decode worker is "
                        "an expert-parallel group of N ranks stepping in lockstep")
    g.add_argument("--encode-workers", type=int, default=None, metavar="E",
                   help="encode worker processes running the vision tower of a vision-language "
                        "model (E/P/D; needs --prefill-workers, --decode-workers and a --kv-store; "
                        "default: prefill workers encode images themselves)")
    g.add_argument("--encode-router", default="least-patches", choices=["least-patches", "round-robin"],
                   help="encode routing policy (default: least queued image patches)")
    g.add_argument("--encode-cache", default="1GiB", metavar="SIZE",
                   help="each encode worker's LRU cache of image embeddings (default 1GiB)")
    g = group(parser, "prefix-store")
    g.add_argument("--kv-store", default="fs",
                   help=f"shared prefix store: {STORE_URL_HELP}, or none")
    g.add_argument("--kv-store-capacity", default=None, metavar="SIZE",
                   help="most bytes the fs prefix store keeps, least recently used blocks "
                        "evicted first, e.g. 64GiB (default 16GiB for all models under its "
                        "root; Redis: the server's maxmemory)")
    g.add_argument("--kv-host-cache", default=None, metavar="SIZE",
                   help="host-memory tier per prefill worker in front of the shared store: "
                        "recently used blocks in DRAM, least recently used evicted, e.g. 2GiB")
    g = group(parser, "disaggregation")
    g.add_argument("--cpu-affinity", action="store_true",
                   help="pin each worker process to its own cores (disjoint groups of the "
                        "cores this process may use; shared round-robin when fewer cores "
                        "than workers)")
    g.add_argument("--prefill-router", default=DEFAULT_PREFILL_POLICY,
                   choices=sorted(PREFILL_POLICIES))
    g.add_argument("--decode-router", default=DEFAULT_DECODE_POLICY,
                   choices=sorted(DECODE_POLICIES))
    g.add_argument("--kv-transfer-timeout", type=float, default=10.0,
                   help="seconds a KV transfer (incl. decode allocation) may take")
    g.add_argument("--kv-staging-memory", default="2GiB", metavar="SIZE",
                   help="host memory each prefill worker may hold for KV not yet pulled by a "
                        "decode worker; beyond it prompts wait and the router looks elsewhere")
    g = group(parser, "health")
    g.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="seconds of silence after which a worker is removed from routing")
    g.add_argument("--loop-stall-timeout", type=float, default=30.0,
                   help="seconds an engine loop may go without advancing (a hung step, a "
                        "stopped process) before its worker is taken out of routing, or the "
                        "colocated engine is killed and restarted; above the longest step")
    from deepinfer.cluster.launcher import add_placement_args
    add_placement_args(parser)  # --cluster local|ray|ray://..., per-role Ray resources


def cluster_config_from_args(args: argparse.Namespace, decode_ep=None):
    """(ClusterConfig, launcher) when worker counts are given, else None (colocated serving).
    `decode_ep`: an expert-parallel `EPConfig` for the decode workers (each one a group of
    `decode_ep.data_parallel_size` ranks); the client is picked by `clients.factory`."""
    num_encode = getattr(args, "encode_workers", None)
    if num_encode is not None and (args.prefill_workers is None or args.decode_workers is None):
        raise ValueError("--encode-workers needs --prefill-workers and --decode-workers "
                         "(colocated serving runs the vision tower in the engine)")
    if num_encode is not None and num_encode < 1:
        raise ValueError(f"--encode-workers must be at least 1, got {num_encode}")
    if args.prefill_workers is None and args.decode_workers is None:
        if getattr(args, "cluster", "local") != "local":
            raise ValueError(f"--cluster {args.cluster} places disaggregated workers: give "
                             f"--prefill-workers and --decode-workers")
        return None
    if args.prefill_workers is None or args.decode_workers is None:
        raise ValueError("--prefill-workers and --decode-workers go together")
    decode_dp = getattr(args, "decode_data_parallel_size", 1)
    if decode_dp < 1:
        raise ValueError("--decode-data-parallel-size must be >= 1")
    from deepinfer.cluster.cluster_config import ClusterConfig

    if args.kv_store == "memory":
        raise ValueError("--kv-store memory is per process; workers need fs or redis (or none)")
    from deepinfer.runtime.kv_cache import parse_memory

    store_url = _store_url_with_capacity(args)
    if store_url not in (None, "none"):
        from deepinfer.kvstore import open_store
        open_store(store_url, b"\0" * 16).close()  # validate the URL now
    from deepinfer.cluster.launcher import launcher_from_args, placement_config
    launcher = launcher_from_args(args)  # --cluster ray: connects to (or starts) Ray here
    num_decode = args.decode_workers * (1 if decode_ep is not None else decode_dp)
    cluster = ClusterConfig(
        num_prefill_workers=args.prefill_workers, num_decode_workers=num_decode,
        kv_store_url=store_url, prefill_router=args.prefill_router,
        decode_router=args.decode_router, transfer_timeout_s=args.kv_transfer_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
        loop_stall_timeout_s=getattr(args, "loop_stall_timeout", 30.0),
        max_staged_bytes=parse_memory(getattr(args, "kv_staging_memory", "2GiB")),
        # serve's --max-engine-restarts also bounds restarts of each lost worker
        max_worker_restarts=getattr(args, "max_engine_restarts", 5),
        cpu_affinity=getattr(args, "cpu_affinity", False),
        **encode_config(args, launcher), **placement_config(args, launcher))
    launcher.check(cluster)  # e.g. no Ray node for a role: one line, before anything starts
    if decode_ep is not None and launcher.name != "local":
        raise ValueError("expert-parallel decode groups run on --cluster local only")
    return cluster, launcher


def _store_url_with_capacity(args: argparse.Namespace) -> str | None:
    """--kv-store with --kv-store-capacity and --kv-host-cache folded in (workers only get
    the store's URL)."""
    url = _store_url_capacity_only(args)
    if getattr(args, "kv_host_cache", None) is None:
        return url
    if url in (None, "none"):
        raise ValueError("--kv-host-cache needs a shared store (--kv-store is none)")
    from deepinfer.kvstore.factory import with_host_cache
    from deepinfer.runtime.kv_cache import parse_memory
    return with_host_cache(url, parse_memory(args.kv_host_cache))


def _store_url_capacity_only(args: argparse.Namespace) -> str | None:
    if getattr(args, "kv_store_capacity", None) is None:
        return args.kv_store
    if args.kv_store in (None, "none"):
        raise ValueError("--kv-store-capacity needs a store (--kv-store is none)")
    from deepinfer.kvstore.factory import with_capacity
    from deepinfer.runtime.kv_cache import parse_memory
    return with_capacity(args.kv_store, parse_memory(args.kv_store_capacity))


def encode_config(args: argparse.Namespace, launcher) -> dict:
    """ClusterConfig fields of the encode stage (--encode-workers, --encode-router, --encode-cache)."""
    num = getattr(args, "encode_workers", None)
    if not num:
        return {}
    if launcher.name != "local":
        raise ValueError("--encode-workers runs on --cluster local only")
    from deepinfer.runtime.kv_cache import parse_memory
    return {"num_encode_workers": num, "encode_router": args.encode_router,
            "encode_cache_bytes": parse_memory(args.encode_cache)}
