"""What the simulator adds to a profile's model time: the engine loop's measured host work per
step, and processor sharing of the host's cores between busy workers. Pure and fast."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.bench.workloads import BenchRequest
from deepinfer.core.cost_model import ChunkShape
from deepinfer.sim import ClusterSimulator, cluster_from_dict
from deepinfer.sim.step_time import HostOverhead, ProfileStepTime, load_cost_profile

PROFILE = str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
              / "cost_profile_smollm2_bf16_cpu_1thread.json")


def _profile_with_host(tmp_path, per_step_s: float, per_request_s: float) -> str:
    with open(PROFILE) as f:
        data = json.load(f)
    data["metadata"]["host_overhead"] = {"per_step_s": per_step_s,
                                         "per_request_s": per_request_s}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_profile_step_time_adds_the_measured_host_overhead(tmp_path):
    model = load_cost_profile(_profile_with_host(tmp_path, 0.004, 0.0005))
    step = ProfileStepTime(model, time_scale=2.0)
    chunks = [ChunkShape(100, 1), ChunkShape(200, 1), ChunkShape(0, 64)]
    # Host work is CPU time of the loop: not scaled with the model's time.
    assert step.step_time_s(chunks) == pytest.approx(2.0 * model.predict(chunks) + 0.004
                                                     + 3 * 0.0005)
    assert step.step_time_s([]) == 0.0


def test_profile_without_host_overhead_is_model_time_only():
    model = load_cost_profile(PROFILE)
    assert "host_overhead" not in model.metadata
    chunks = [ChunkShape(0, 128)]
    assert ProfileStepTime(model).step_time_s(chunks) == pytest.approx(model.predict(chunks))


def test_host_overhead_rejects_negative():
    with pytest.raises(ValueError, match=">= 0"):
        HostOverhead(per_step_s=-1e-3)


def _two_workers_one_core(profile: str, cores, sharing: str = "fair"):
    data = {"cost": {"profile": profile}, "engine": {"num_kv_blocks": 256},
            "pools": {"colocated": {"workers": 2}}, "routers": {"prefill": "round-robin"}}
    if cores is not None:
        data["host"] = {"cores": cores, "sharing": sharing}
    return ClusterSimulator(cluster_from_dict(data))


def test_workers_sharing_a_core_advance_at_half_speed_while_both_are_busy():
    """Request a starts alone at 0, b (on the other worker) at d < T: a runs alone until d,
    then both at half speed. Processor sharing: both first tokens come at 2T - d after
    their arrivals (a snapshot at step start would give a its whole step at full speed)."""
    ids = list(range(1000, 1128))
    step_model = _two_workers_one_core(PROFILE, 1).workers["colocated-0"].step_model
    t = step_model.step_time_s([ChunkShape(0, len(ids))])
    d = 0.25 * t
    sim = _two_workers_one_core(PROFILE, 1)
    a, b = sim.run([BenchRequest(ids, 1, 0.0), BenchRequest(ids[::-1], 1, d)])
    assert {a.prefill_worker, b.prefill_worker} == {"colocated-0", "colocated-1"}
    assert a.token_times_s[0] - a.arrival_s == pytest.approx(2 * t - d)
    assert b.token_times_s[0] - b.arrival_s == pytest.approx(2 * t - d)
    # Sharing stretches the time in steps, not the work (each worker's CPU seconds).
    assert [w.work_time_s for w in sim.workers.values()] == pytest.approx([t, t])
    assert sum(w.busy_time_s for w in sim.workers.values()) == pytest.approx(4 * t - 2 * d)
    # Own cores each (no host sharing): both take T.
    sim = _two_workers_one_core(PROFILE, None)
    a, b = sim.run([BenchRequest(ids, 1, 0.0), BenchRequest(ids[::-1], 1, d)])
    assert a.token_times_s[0] - a.arrival_s == pytest.approx(t)
    assert b.token_times_s[0] - b.arrival_s == pytest.approx(t)


def test_at_start_sharing_fixes_a_steps_speed_when_it_starts():
    """The older model, kept for comparison: a started alone keeps full speed (T); b started
    while a was busy runs at half speed throughout (2T)."""
    ids = list(range(1000, 1128))
    sim = _two_workers_one_core(PROFILE, 1, "at-start")
    t = sim.workers["colocated-0"].step_model.step_time_s([ChunkShape(0, len(ids))])
    a, b = sim.run([BenchRequest(ids, 1, 0.0), BenchRequest(ids[::-1], 1, 0.25 * t)])
    assert a.token_times_s[0] - a.arrival_s == pytest.approx(t)
    assert b.token_times_s[0] - b.arrival_s == pytest.approx(2 * t)


def test_unknown_host_sharing_is_an_error():
    with pytest.raises(ValueError, match="host.sharing"):
        _two_workers_one_core(PROFILE, 1, "greedy")


def test_enough_cores_means_no_slowdown():
    ids = list(range(1000, 1064))
    sim = _two_workers_one_core(PROFILE, 2)
    t = sim.workers["colocated-0"].step_model.step_time_s([ChunkShape(0, len(ids))])
    a, b = sim.run([BenchRequest(ids, 1, 0.0), BenchRequest(ids[::-1], 1, 0.0)])
    assert a.token_times_s[0] == pytest.approx(t)
    assert b.token_times_s[0] == pytest.approx(t)
    assert sum(w.busy_time_s for w in sim.workers.values()) == pytest.approx(2 * t)
    assert sum(w.work_time_s for w in sim.workers.values()) == pytest.approx(2 * t)


def _pd_one_each(profile: str):
    return ClusterSimulator(cluster_from_dict({
        "cost": {"profile": profile},
        "engine": {"num_kv_blocks": 256, "max_num_batched_tokens": 256},
        "pools": {"prefill": {"workers": 1}, "decode": {"workers": 1}},
        "prefix_store": {"bandwidth_gb_s": 1.0, "latency_ms": 1.0}}))


def test_prefill_worker_pays_its_measured_store_publish_cpu(tmp_path):
    """Two 256-token prompts on one prefill worker, one step each: the second waits for the
    first's step plus the CPU its worker spends publishing the first's 16 computed blocks."""
    with open(PROFILE) as f:
        data = json.load(f)
    data["metadata"]["store_publish"] = {"s_per_byte": 2e-9}
    published = tmp_path / "publish.json"
    published.write_text(json.dumps(data))
    requests = [BenchRequest(list(range(1000, 1256)), 4, 0.0),
                BenchRequest(list(range(2000, 2256)), 4, 0.0)]
    base = _pd_one_each(PROFILE).run(requests)
    sim = _pd_one_each(str(published))
    kv_bytes = sim.workers["prefill-0"].step_model.kv_bytes_per_token
    runs = sim.run(requests)
    assert runs[0].token_times_s[0] == pytest.approx(base[0].token_times_s[0])
    assert runs[1].token_times_s[0] - base[1].token_times_s[0] == pytest.approx(
        256 * kv_bytes * 2e-9)


def test_measured_sharing_uses_the_profiles_speed_table(tmp_path):
    """A table that says two processes at once each run at half speed gives the same answer
    as fair sharing of one core; without a table, measured sharing is an error."""
    with open(PROFILE) as f:
        data = json.load(f)
    data["metadata"]["host_sharing"] = {"speed": [1.0, 0.5]}
    path = tmp_path / "sharing.json"
    path.write_text(json.dumps(data))
    ids = list(range(1000, 1128))
    sim = _two_workers_one_core(str(path), 2, "measured")
    t = sim.workers["colocated-0"].step_model.step_time_s([ChunkShape(0, len(ids))])
    a, b = sim.run([BenchRequest(ids, 1, 0.0), BenchRequest(ids[::-1], 1, 0.25 * t)])
    assert a.token_times_s[0] - a.arrival_s == pytest.approx(2 * t - 0.25 * t)
    assert b.token_times_s[0] - b.arrival_s == pytest.approx(2 * t - 0.25 * t)
    with pytest.raises(ValueError, match="host-sharing"):
        _two_workers_one_core(PROFILE, 2, "measured")
