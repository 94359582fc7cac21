"""Disaggregated serving: prefill, decode and encode worker processes, KV transport,
launchers (local, Ray) and the worker bookkeeping the front's `clients.disagg` builds on.
"""
from deepinfer.cluster.cluster_config import ClusterConfig

__all__ = ["ClusterConfig"]
