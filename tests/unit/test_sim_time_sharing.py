"""A time-shared core's steps cost more CPU (`sim.time_sharing`, `host.time_sharing`): the
processor-sharing arithmetic with an efficiency, no effect with spare cores or without the key,
and the checks on the numbers. Pure and fast."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.bench.workloads import BenchRequest
from deepinfer.cli.main import main
from deepinfer.core.cost_model import ChunkShape
from deepinfer.sim import ClusterSimulator, cluster_from_dict
from deepinfer.sim.time_sharing import TimeSharing, time_sharing_from_dict

PROFILE = str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
              / "cost_profile_smollm2_bf16_cpu_1thread.json")
IDS = list(range(1000, 1128))


def _sim(cores, time_sharing=None, profile: str = PROFILE, workers: int = 2,
         pools: dict | None = None) -> ClusterSimulator:
    data = {"cost": {"profile": profile}, "engine": {"num_kv_blocks": 256},
            "pools": pools or {"colocated": {"workers": workers}},
            "routers": {"prefill": "round-robin"}, "host": {"cores": cores}}
    if time_sharing is not None:
        data["host"]["time_sharing"] = time_sharing
    return ClusterSimulator(cluster_from_dict(data))


def _prefill_time(sim: ClusterSimulator) -> float:
    return sim.workers["colocated-0"].step_model.step_time_s([ChunkShape(0, len(IDS))])


def test_time_shared_steps_advance_at_speed_times_efficiency():
    """1 core, efficiency 0.5. a runs alone from 0 to d (full speed), then a and b share the
    core: each at 1/2 × 0.5 = 1/4 of full speed, so a's T - d left takes 4(T - d); then b's
    remaining d runs alone at full speed. Both first tokens: 4T - 3d after arrival. Each
    worker's work stays T; its CPU seconds are d + (T - d) / 0.5 = 2T - d."""
    sim = _sim(1, {"decode": 0.5, "prefill": 0.5})
    t = _prefill_time(sim)
    d = 0.25 * t
    a, b = sim.run([BenchRequest(IDS, 1, 0.0), BenchRequest(IDS[::-1], 1, d)])
    assert {a.prefill_worker, b.prefill_worker} == {"colocated-0", "colocated-1"}
    assert a.token_times_s[0] - a.arrival_s == pytest.approx(4 * t - 3 * d)
    assert b.token_times_s[0] - b.arrival_s == pytest.approx(4 * t - 3 * d)
    assert [w.work_time_s for w in sim.workers.values()] == pytest.approx([t, t])
    assert list(sim.cpu_time_s.values()) == pytest.approx([2 * t - d, 2 * t - d])


def test_spare_cores_mean_no_inflation():
    sim = _sim(2, {"decode": 0.5, "prefill": 0.5})
    t = _prefill_time(sim)
    a, b = sim.run([BenchRequest(IDS, 1, 0.0), BenchRequest(IDS[::-1], 1, 0.0)])
    assert a.token_times_s[0] == pytest.approx(t)
    assert b.token_times_s[0] == pytest.approx(t)
    assert list(sim.cpu_time_s.values()) == pytest.approx([t, t])


def _pd_requests() -> list[BenchRequest]:
    return [BenchRequest([1000 + 7 * i + j for j in range(40 + 23 * i)], 6 + i % 5, 0.03 * i)
            for i in range(12)]


def _pd(time_sharing) -> ClusterSimulator:
    return _sim(2, time_sharing, pools={"prefill": {"workers": 2}, "decode": {"workers": 2}})


def test_absent_is_todays_run_and_efficiency_one_changes_nothing():
    """Without the key the run is the same event for event; efficiencies of 1 likewise, and
    the CPU estimate then equals the work."""
    runs = []
    for time_sharing in (None, {"decode": 1.0, "prefill": 1.0}, None):
        sim = _pd(time_sharing)
        records = sim.run(_pd_requests())
        runs.append([(r.token_times_s, r.prefill_worker) for r in records])
        work = sum(w.work_time_s for w in sim.workers.values())
        assert sum(sim.cpu_time_s.values()) == pytest.approx(work)
    assert runs[0] == runs[1] == runs[2]  # exact, not approx
    slower = _pd({"decode": 0.5, "prefill": 0.8}).run(_pd_requests())
    assert sum(r.token_times_s[-1] for r in slower) > sum(r[0][-1] for r in runs[0])


def test_step_kinds_follow_the_piecewise_split():
    ts = TimeSharing(decode=0.9, prefill=0.7, large_decode=0.8)
    assert ts.efficiency([ChunkShape(300, 1)] * 8) == 0.9
    assert ts.efficiency([ChunkShape(300, 1)] * 9) == 0.8
    assert ts.efficiency([ChunkShape(300, 1), ChunkShape(0, 64)]) == 0.7
    assert TimeSharing(decode=0.9, prefill=0.7).efficiency([ChunkShape(300, 1)] * 16) == 0.7
    assert TimeSharing(0.9, 0.7, small_decode_rows=4).efficiency([ChunkShape(9, 1)] * 5) == 0.7


@pytest.mark.parametrize("bad", [0, 0.0, -0.2, 1.01, 2, "0.5", True, None])
def test_values_outside_zero_one_are_rejected(bad):
    with pytest.raises(ValueError, match="time_sharing"):
        time_sharing_from_dict({"decode": bad, "prefill": 0.9})
    with pytest.raises(ValueError, match="time_sharing"):
        _sim(1, {"decode": 0.9, "prefill": bad})


def test_cluster_file_checks_keys_and_needs_cores():
    with pytest.raises(ValueError, match="unknown keys"):
        _sim(1, {"decode": 0.9, "prefill": 0.9, "mixed": 0.5})
    with pytest.raises(ValueError, match="time_sharing"):
        _sim(1, "sometimes")
    with pytest.raises(ValueError, match="needs host.cores"):
        cluster_from_dict({"cost": {"profile": PROFILE}, "pools": {"colocated": {}},
                           "host": {"time_sharing": {"decode": 0.9, "prefill": 0.9}}})


def _profile_with(tmp_path, time_sharing) -> str:
    data = json.loads(Path(PROFILE).read_text())
    if time_sharing is not None:
        data["metadata"]["time_sharing"] = time_sharing
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_measured_reads_the_profile_and_checks_it(tmp_path):
    measured = {"decode": 0.5, "prefill": 0.5, "method": "test", "rounds": {}}
    sim = _sim(1, "measured", profile=_profile_with(tmp_path, measured))
    assert (sim.time_sharing.decode, sim.time_sharing.prefill) == (0.5, 0.5)
    with pytest.raises(ValueError, match=r"--time-sharing"):
        _sim(1, "measured", profile=_profile_with(tmp_path, None))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        _sim(1, "measured", profile=_profile_with(tmp_path, {"decode": 1.3, "prefill": 0.9}))


def test_measured_noise_just_over_one_reads_as_one(tmp_path):
    # 1.012 was measured on a quiet box (noise: sharing never speeds a step up); a profile
    # holding it was refused and the validation crashed before the simulator read it as 1.
    noisy = {"decode": 1.012, "prefill": 0.96, "large_decode": 0.9}
    sim = _sim(1, "measured", profile=_profile_with(tmp_path, noisy))
    assert (sim.time_sharing.decode, sim.time_sharing.prefill) == (1.0, 0.96)


def test_profile_update_needs_a_measurement_to_add(tmp_path, capsys):
    out = str(tmp_path / "out.json")
    assert main(["profile", "--update", PROFILE, "--out", out]) == 2
    assert "--time-sharing" in capsys.readouterr().err
    assert main(["profile", "--update", str(tmp_path / "missing.json"), "--time-sharing",
                 "--out", out]) == 2


@pytest.mark.slow  # loads the model in a second process
def test_measure_time_sharing_restores_affinity_and_threads(make_engine_llm):
    """The real measurement, as short as it goes: every kind gets a positive ratio, and the
    process's core affinity and torch threads are what they were."""
    import os

    import torch

    from deepinfer.bench.host_contention import measure_time_sharing

    llm = make_engine_llm(num_kv_blocks=128)
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    out = measure_time_sharing(llm.engine.runner, llm.engine.model_config.vocab_size,
                               {"dtype": "float32", "device": "cpu", "num_threads": 1,
                                "num_kv_blocks": 128}, cpu_s=0.05, repeats=1, batches={
                                   "decode": ((ChunkShape(16, 1),) * 2,),
                                   "large_decode": ((ChunkShape(16, 1),) * 10,),
                                   "prefill": ((ChunkShape(0, 32),),)})
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads
    for kind in ("decode", "large_decode", "prefill"):
        assert 0 < out[kind] < 2 and len(out["rounds"][kind]) == 1
    assert out["core"] in affinity
