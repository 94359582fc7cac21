"""The cluster a simulation runs: pools of workers, routers, links and the prefix store. Pure.

A cluster file (YAML or JSON; `load_cluster_file`) looks like:

    cost:    {profile: benchmarks/results/cost_profile_smollm2_bf16_cpu_1thread.json}
    # or     {accelerator: H800, model: deepseek-v3, num_accelerators: 8, ep_size: 32, mfu: 0.6}
    #          roofline + expert_load: {distribution: zipf, exponent: 0.8, drift_per_minute: 0.1,
    #          seed: 0, window_size: 1000, step_interval: 3000, initial: identity}: per-rank
    #          expert imbalance and the engine's EPLB planner in the loop (sim.expert_load)
    engine:  {num_kv_blocks: 8192, block_size: 16, max_num_batched_tokens: 2048}
    pools:
      prefill: {workers: 2}
      decode:  {workers: 2, cost: {ep_size: 144}}   # per-pool keys override the top level
    # or pools: {colocated: {workers: 1}}
    routers:      {prefill: least-compute, decode: balanced}
    prefix_store: {capacity_blocks: 200000, bandwidth_gb_s: 2.0, latency_ms: 0.5}  # or none
    kv_transfer:  {bandwidth_gb_s: 1.0, latency_ms: 1.0}
    host:         {cores: 2}   # workers share these CPU cores (omit for one device each);
                               # sharing: fair (default) | at-start | measured (simulator.py)
                               # front_cpu / client_cpu / kv_transfer_cpu_s_per_gb: other
                               # CPU consumers on those cores (sim.host_load)
                               # time_sharing: measured | {decode: .., prefill: ..}: a
                               # time-shared core's steps cost more CPU (sim.time_sharing)
                               # memory_contention: measured | {decode_with_decode: ..,
                               # decode_with_prefill: ..}: small decode steps slow while
                               # another worker steps (sim.memory_contention)
    noise:        {step_time_cv: 0.04, arrival_jitter_ms: 2.0, seed: 0}  # optional: a
                               # perturbed run (sim.perturbation); omit for the deterministic one

Every key is checked; unknown ones raise ValueError (a typo must not be silently ignored).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from deepinfer.routing.policy_names import check_router_names
from deepinfer.sim.host_load import HOST_CPU_KEYS, HostCpuSpec, host_cpu_from_dict
from deepinfer.sim.memory_contention import MemoryContention, memory_contention_from_dict
from deepinfer.sim.time_sharing import TimeSharing, time_sharing_from_dict
from deepinfer.sim.perturbation import NoiseSpec
from deepinfer.sim.roofline import RooflineConfig

POOL_ROLES = ("colocated", "prefill", "decode")
HOST_SHARING = ("fair", "at-start", "measured")


@dataclass(frozen=True)
class EngineSpec:
    """One worker's engine knobs (the names of `EngineConfig` / `deepinfer serve` flags)."""

    num_kv_blocks: int = 8192
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 32768
    enable_prefix_caching: bool = True
    scheduler: str = "token-budget"  # token-budget | compute-aware
    step_time_budget_ms: float | None = None
    threads: int = 1  # CPU threads one worker keeps busy (host contention model)

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("engine.max_model_len must be >= 2")
        if self.scheduler not in ("token-budget", "compute-aware"):
            raise ValueError("engine.scheduler must be token-budget or compute-aware")
        if self.step_time_budget_ms is not None and not self.step_time_budget_ms > 0:
            raise ValueError("engine.step_time_budget_ms must be positive")


@dataclass(frozen=True)
class CostSpec:
    """Where step times come from: a measured profile, or an accelerator + model roofline."""

    profile: str | None = None
    time_scale: float = 1.0  # profile only: multiply predictions (e.g. a slower device)
    accelerator: str | None = None
    model: str | None = None
    roofline: RooflineConfig = field(default_factory=RooflineConfig)

    def __post_init__(self) -> None:
        analytic = self.accelerator is not None or self.model is not None
        if (self.profile is None) == (not analytic):
            raise ValueError("cost: give either profile, or accelerator and model")
        if analytic and (self.accelerator is None or self.model is None):
            raise ValueError("cost: the roofline needs both accelerator and model")
        if not self.time_scale > 0:
            raise ValueError("cost.time_scale must be positive")

    @property
    def num_accelerators(self) -> int:
        """Accelerators one worker occupies (a profiled worker counts as one)."""
        return 1 if self.profile is not None else self.roofline.num_accelerators


@dataclass(frozen=True)
class PoolSpec:
    role: str
    num_workers: int
    engine: EngineSpec
    cost: CostSpec

    def __post_init__(self) -> None:
        if self.role not in POOL_ROLES:
            raise ValueError(f"pool role must be one of {POOL_ROLES}, got {self.role!r}")
        if self.num_workers < 1:
            raise ValueError(f"pools.{self.role}.workers must be >= 1")


@dataclass(frozen=True)
class LinkSpec:
    """A KV path: `bandwidth_gb_s` GB/s (1e9 bytes) per destination, plus `latency_ms`."""

    bandwidth_gb_s: float = 10.0
    latency_ms: float = 0.5

    def __post_init__(self) -> None:
        if not self.bandwidth_gb_s > 0 or self.latency_ms < 0:
            raise ValueError("bandwidth_gb_s must be positive and latency_ms >= 0")

    def seconds(self, num_bytes: float) -> float:
        return self.latency_ms / 1e3 + num_bytes / (self.bandwidth_gb_s * 1e9)


@dataclass(frozen=True)
class StoreSpec:
    """The shared prefix store: LRU over `capacity_blocks` blocks (None: unbounded)."""

    capacity_blocks: int | None = None
    bandwidth_gb_s: float = 5.0
    latency_ms: float = 0.5

    def __post_init__(self) -> None:
        if self.capacity_blocks is not None and self.capacity_blocks < 1:
            raise ValueError("prefix_store.capacity_blocks must be >= 1")
        LinkSpec(self.bandwidth_gb_s, self.latency_ms)  # same checks

    @property
    def link(self) -> LinkSpec:
        return LinkSpec(self.bandwidth_gb_s, self.latency_ms)


@dataclass(frozen=True)
class ClusterSpec:
    pools: tuple[PoolSpec, ...]
    prefill_router: str = "least-compute"
    decode_router: str = "balanced"
    report_interval_s: float = 0.2
    kv_transfer: LinkSpec = field(default_factory=LinkSpec)
    prefix_store: StoreSpec | None = field(default_factory=StoreSpec)
    host_cores: int | None = None
    host_sharing: str = "fair"  # fair | at-start | measured: see sim.simulator
    front_latency_ms: float = 0.0
    noise: NoiseSpec | None = None  # None: deterministic (no perturbation)
    host_cpu: HostCpuSpec | None = None  # front / client / KV-transfer CPU (sim.host_load)
    # "measured" (the profile's) or a TimeSharing; None: steps cost the same time-shared
    host_time_sharing: str | TimeSharing | None = None
    # "measured" (the profile's) or a MemoryContention; None: a neighbour's step costs nothing
    host_memory_contention: str | MemoryContention | None = None

    def __post_init__(self) -> None:
        roles = [p.role for p in self.pools]
        if len(set(roles)) != len(roles):
            raise ValueError("each pool role may appear once")
        if set(roles) not in ({"colocated"}, {"prefill", "decode"}):
            raise ValueError("pools: give colocated, or both prefill and decode")
        check_router_names(self.prefill_router, self.decode_router)
        if not self.report_interval_s > 0:
            raise ValueError("report_interval_s must be positive")
        if self.host_cores is not None and self.host_cores < 1:
            raise ValueError("host.cores must be >= 1")
        if self.host_sharing not in HOST_SHARING:
            raise ValueError(f"host.sharing must be one of {HOST_SHARING}")
        if self.front_latency_ms < 0:
            raise ValueError("front_latency_ms must be >= 0")
        if self.host_cpu is not None and self.host_cores is None:
            raise ValueError("host: front_cpu / client_cpu / kv_transfer_cpu_s_per_gb need "
                             "host.cores (they share the workers' cores)")
        if self.host_time_sharing is not None:
            if self.host_cores is None:
                raise ValueError("host.time_sharing needs host.cores")
            if not (self.host_time_sharing == "measured"
                    or isinstance(self.host_time_sharing, TimeSharing)):
                raise ValueError("host.time_sharing must be 'measured' or "
                                 "{decode: .., prefill: .., large_decode: ..}")
        if self.host_memory_contention is not None and not (
                self.host_memory_contention == "measured"
                or isinstance(self.host_memory_contention, MemoryContention)):
            raise ValueError("host.memory_contention must be 'measured' or "
                             "{decode_with_decode: .., decode_with_prefill: ..}")

    @property
    def disaggregated(self) -> bool:
        return any(p.role == "prefill" for p in self.pools)

    def pool(self, role: str) -> PoolSpec | None:
        return next((p for p in self.pools if p.role == role), None)

    def with_workers(self, **counts: int) -> "ClusterSpec":
        """A copy with some pools resized, e.g. `with_workers(prefill=2, decode=3)`."""
        pools = tuple(dataclasses.replace(p, num_workers=counts.get(p.role, p.num_workers))
                      for p in self.pools)
        return dataclasses.replace(self, pools=pools)

    def num_accelerators(self) -> int:
        return sum(p.num_workers * p.cost.num_accelerators for p in self.pools)

    def describe(self) -> str:
        return " + ".join(f"{p.num_workers} {p.role}" for p in self.pools)


# ---- parsing ------------------------------------------------------------------------------
_TOP_KEYS = {"cost", "engine", "pools", "routers", "prefix_store", "kv_transfer", "host",
             "report_interval_s", "front_latency_ms", "noise"}
_ROOFLINE_KEYS = {f.name for f in dataclasses.fields(RooflineConfig)}
_COST_KEYS = {"profile", "time_scale", "accelerator", "model"} | _ROOFLINE_KEYS


def _check_keys(where: str, data: Any, allowed: set[str]) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    return data


def _build(cls, where: str, data: dict):
    try:
        return cls(**data)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None


def cost_spec_from_dict(data: dict, base_dir: str = ".") -> CostSpec:
    data = dict(_check_keys("cost", data, _COST_KEYS))
    roofline = _build(RooflineConfig, "cost", {k: data.pop(k) for k in list(data)
                                               if k in _ROOFLINE_KEYS})
    profile = data.get("profile")
    if profile is not None and not os.path.isabs(profile):
        beside = os.path.join(base_dir, profile)
        data["profile"] = beside if os.path.exists(beside) else profile
    return _build(CostSpec, "cost", {**data, "roofline": roofline})


def cluster_from_dict(data: dict, base_dir: str = ".") -> ClusterSpec:
    """A ClusterSpec from a parsed cluster file (see the module docstring)."""
    data = _check_keys("cluster", data, _TOP_KEYS)
    engine_keys = {f.name for f in dataclasses.fields(EngineSpec)}
    engine = _check_keys("engine", data.get("engine"), engine_keys)
    cost = _check_keys("cost", data.get("cost"), _COST_KEYS)
    pools_data = _check_keys("pools", data.get("pools"), set(POOL_ROLES))
    if not pools_data:
        raise ValueError("pools: give colocated, or both prefill and decode")
    pools = []
    for role, pool in pools_data.items():
        pool = _check_keys(f"pools.{role}", pool, {"workers", "engine", "cost"})
        pool_engine = _check_keys(f"pools.{role}.engine", pool.get("engine"), engine_keys)
        pool_cost = _check_keys(f"pools.{role}.cost", pool.get("cost"), _COST_KEYS)
        pools.append(PoolSpec(
            role=role, num_workers=int(pool.get("workers", 1)),
            engine=_build(EngineSpec, f"pools.{role}.engine", {**engine, **pool_engine}),
            cost=cost_spec_from_dict({**cost, **pool_cost}, base_dir)))
    routers = _check_keys("routers", data.get("routers"), {"prefill", "decode"})
    store_data = data.get("prefix_store", {})
    if store_data in ("none", None, False):
        store = None
    else:
        store = _build(StoreSpec, "prefix_store", _check_keys(
            "prefix_store", store_data, {f.name for f in dataclasses.fields(StoreSpec)}))
    link = _build(LinkSpec, "kv_transfer", _check_keys(
        "kv_transfer", data.get("kv_transfer"), {f.name for f in dataclasses.fields(LinkSpec)}))
    host = _check_keys("host", data.get("host"),
                       {"cores", "sharing", "time_sharing", "memory_contention"} | HOST_CPU_KEYS)
    time_sharing = host.get("time_sharing")
    if isinstance(time_sharing, dict):
        time_sharing = time_sharing_from_dict(_check_keys(
            "host.time_sharing", time_sharing, {"decode", "prefill", "large_decode"}))
    memory_contention = host.get("memory_contention")
    if isinstance(memory_contention, dict):
        memory_contention = memory_contention_from_dict(_check_keys(
            "host.memory_contention", memory_contention,
            {"decode_with_decode", "decode_with_prefill"}))
    noise_data = data.get("noise")
    noise = None if noise_data is None else _build(NoiseSpec, "noise", _check_keys(
        "noise", noise_data, {f.name for f in dataclasses.fields(NoiseSpec)}))
    return ClusterSpec(
        pools=tuple(pools), prefill_router=routers.get("prefill", "least-compute"),
        decode_router=routers.get("decode", "balanced"),
        report_interval_s=float(data.get("report_interval_s", 0.2)), kv_transfer=link,
        prefix_store=store, host_cores=host.get("cores"),
        host_sharing=host.get("sharing", "fair"),
        front_latency_ms=float(data.get("front_latency_ms", 0.0)), noise=noise,
        host_cpu=host_cpu_from_dict(host), host_time_sharing=time_sharing,
        host_memory_contention=memory_contention)


def load_cluster_file(path: str) -> ClusterSpec:
    """Read a YAML (.yaml/.yml) or JSON cluster file; ValueError on any problem."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read cluster file {path}: {e.strerror}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml  # only for YAML files: the package itself needs no third-party parser
        except ImportError:
            raise ValueError("YAML cluster files need PyYAML (pip install pyyaml); "
                             "or write the file as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
    return cluster_from_dict(data, os.path.dirname(os.path.abspath(path)))
