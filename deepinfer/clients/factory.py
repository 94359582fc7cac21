"""`make_client`: the one place that picks the `EngineClient` implementation from the configs.

    cluster (P/D workers) ── decode_ep ──▶ EPDisaggClient   (decode workers are EP groups)
                          └─────────────▶ DisaggClient
    ep_config (rank groups) ─ placement ─▶ RayDataParallelClient
                          └─────────────▶ DataParallelClient
    neither ────────────────────────────▶ ColocatedClient  (one engine process)

`serve`, the Ray paths, benchmarks and test harnesses all build their client here.
"""
from __future__ import annotations

from deepinfer.clients.protocol import EngineClient


def make_client(engine_config, *, cluster=None, decode_ep=None, launcher=None, ep_config=None,
                rank_placement=None, **options) -> EngineClient:
    """An unstarted client. `cluster`: a `ClusterConfig` of prefill/decode workers (placed by
    `launcher`), whose decode workers are expert-parallel groups when `decode_ep` is given.
    `ep_config`: data-parallel rank groups, on Ray when `rank_placement` is given.
    `options`: the colocated / data-parallel clients' keyword options (log level, restart
    policy, timeouts)."""
    if cluster is not None:
        if ep_config is not None or rank_placement is not None:
            raise ValueError("rank groups (--data-parallel-size) are for colocated serving; "
                             "give disaggregated decode groups as decode_ep")
        if options:
            raise TypeError(f"disaggregated clients take no {sorted(options)}")
        if decode_ep is not None:
            from deepinfer.clients.ep_disagg import EPDisaggClient
            return EPDisaggClient(engine_config, cluster, decode_ep, launcher=launcher)
        from deepinfer.clients.disagg import DisaggClient
        return DisaggClient(engine_config, cluster, launcher=launcher)
    if decode_ep is not None or launcher is not None:
        raise ValueError("decode_ep and launcher need a cluster of prefill/decode workers")
    if ep_config is not None:
        if rank_placement is not None:
            from deepinfer.clients.ray_data_parallel import RayDataParallelClient
            return RayDataParallelClient(engine_config, ep_config, rank_placement, **options)
        from deepinfer.clients.data_parallel import DataParallelClient
        return DataParallelClient(engine_config, ep_config, **options)
    if rank_placement is not None:
        raise ValueError("rank_placement needs an ep_config")
    from deepinfer.clients.colocated import ColocatedClient
    return ColocatedClient(engine_config, **options)


def client_from_args(args, engine_config, *, ep_config=None, decode_ep=None,
                     **options) -> EngineClient:
    """The client of `deepinfer serve`'s flags: rank groups when `ep_config` is given (local or
    on Ray), else P/D workers when worker counts are given, else one engine process.
    ValueError for flags that do not go together (checked before anything starts)."""
    if ep_config is not None:
        from deepinfer.ep.ray_rank_group import rank_placement_from_args
        return make_client(engine_config, ep_config=ep_config,
                           rank_placement=rank_placement_from_args(args, ep_config), **options)
    from deepinfer.cluster.cluster_args import cluster_config_from_args
    placed = cluster_config_from_args(args, decode_ep=decode_ep)
    if placed is not None:
        cluster, launcher = placed
        return make_client(engine_config, cluster=cluster, decode_ep=decode_ep,
                           launcher=launcher)
    return make_client(engine_config, **options)
