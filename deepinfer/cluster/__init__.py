"""Disaggregated serving: prefill and decode worker processes, KV transport, front client.

`DisaggClient` (front door) starts P prefill and D decode workers (`worker_proc`), routes
with `routing`'s policies, and streams deltas like the colocated `EngineClient`.
"""
from deepinfer.cluster.cluster_config import ClusterConfig

__all__ = ["ClusterConfig"]
