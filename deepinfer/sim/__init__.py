"""Cluster simulator (pure: stdlib + numpy): the engine's own schedulers, KV cache managers
and routers, with a step-time model (measured cost profile or roofline) in place of the
model runner. See docs/simulator.md."""
from deepinfer.sim.cluster_spec import ClusterSpec, cluster_from_dict, load_cluster_file
from deepinfer.sim.sim_report import SimRun, run_simulation, simulate_workload, to_bench_json
from deepinfer.sim.simulator import ClusterSimulator

__all__ = ["ClusterSimulator", "ClusterSpec", "SimRun", "cluster_from_dict",
           "load_cluster_file", "run_simulation", "simulate_workload", "to_bench_json"]
