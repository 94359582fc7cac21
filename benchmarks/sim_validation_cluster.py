"""The simulated cluster `sim_validation.py` (and the held-out and frozen-calibration scripts)
builds for a case: the profile, the host's cores shared by the workers, the front / client /
KV-transfer CPU of the host-CPU calibration, the measured KV link, and the rules saying which
of the profile's host measurements the simulator applies (a frozen calibration sets them)."""
from __future__ import annotations

import dataclasses
import json
import os

from benchmarks.sim_validation_calibration import host_cpu_keys
from benchmarks.sim_validation_engine import NUM_KV_BLOCKS
from deepinfer.sim import cluster_from_dict
from deepinfer.sim.perturbation import NoiseSpec


def measured_link(profile: str) -> dict:
    """The KV transport `deepinfer profile` measured on this host (stage copy + pull +
    write), or the old stated assumption when the profile has none."""
    with open(profile) as f:
        link = json.load(f).get("metadata", {}).get("kv_transport")
    if not link:
        return {"bandwidth_gb_s": 1.0, "latency_ms": 2.0}
    return {"bandwidth_gb_s": link["bandwidth_gb_s"], "latency_ms": link["latency_ms"]}


def sim_cluster(profile: str, pools: dict, sharing: str = "fair",
                noise: NoiseSpec | None = None) -> object:
    cluster = cluster_from_dict({
        "cost": {"profile": profile},
        "engine": {"num_kv_blocks": NUM_KV_BLOCKS, "threads": 1},
        "pools": pools, "host": {"cores": os.cpu_count(), "sharing": sharing,
                                 **host_cpu_keys(profile, pools),  # front, client, KV-transfer CPU
                                 **time_sharing_key(profile), **memory_contention_key(profile)},
        "kv_transfer": measured_link(profile),
        "prefix_store": {"bandwidth_gb_s": 1.0, "latency_ms": 1.0}})
    return dataclasses.replace(cluster, noise=noise)


def time_sharing_key(profile: str) -> dict:
    """`time_sharing: measured` when the profile has `deepinfer profile --time-sharing`'s
    numbers (a time-shared core's steps cost more CPU); nothing otherwise."""
    if not _RULES["time_sharing"]:
        return {}
    with open(profile) as f:
        measured = json.load(f).get("metadata", {}).get("time_sharing")
    return {"time_sharing": "measured"} if measured else {}


# How the simulated clusters use the profile's host measurements; a frozen calibration's
# manifest sets them (`use_rules`), the defaults use everything the profile has.
_RULES = {"memory_contention": True, "time_sharing": True}


def use_rules(rules: dict) -> None:
    unknown = set(rules) - set(_RULES) - {"host_sharing"}
    if unknown:
        raise ValueError(f"unknown simulator rules {sorted(unknown)}")
    _RULES.update({k: bool(v) for k, v in rules.items() if k in _RULES})


def memory_contention_key(profile: str) -> dict:
    """`memory_contention: measured` when the profile has `deepinfer profile
    --memory-contention`'s numbers (a small decode step slows while another worker steps on
    another core) and the rules use it; nothing otherwise."""
    if not _RULES["memory_contention"]:
        return {}
    with open(profile) as f:
        measured = json.load(f).get("metadata", {}).get("memory_contention")
    return {"memory_contention": "measured"} if measured else {}
