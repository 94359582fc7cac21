"""Other CPU consumers on the simulated host (sim.host_load): the front door, the client and
the KV transport's threads share the workers' cores under processor sharing. Pure and fast."""
from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.bench.workloads import BenchRequest
from deepinfer.core.cost_model import ChunkShape
from deepinfer.sim import ClusterSimulator, cluster_from_dict

PROFILE = str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
              / "cost_profile_smollm2_bf16_cpu_1thread.json")
IDS = list(range(1000, 1128))


def _sim(pools: dict, host: dict | None, **extra) -> ClusterSimulator:
    data = {"cost": {"profile": PROFILE}, "engine": {"num_kv_blocks": 256},
            "pools": pools, "prefix_store": "none", **extra}
    if host is not None:
        data["host"] = host
    return ClusterSimulator(cluster_from_dict(data), check_invariants=True)


COLOCATED = {"colocated": {"workers": 1}}
PD = {"prefill": {"workers": 1}, "decode": {"workers": 1}}


def _step_s(sim: ClusterSimulator, chunk: ChunkShape) -> float:
    return next(iter(sim.workers.values())).step_model.step_time_s([chunk])


def test_a_front_job_slows_the_worker_as_processor_sharing_says():
    """One core; the request's front work F starts with its prefill step T (F < T): both run
    at half speed until F is done at 2F, then the step alone: first token at T + F. The token
    then costs the front P while the decode step D runs (P < D): second token D + P later."""
    f, p = 0.004, 0.002
    sim = _sim(COLOCATED, {"cores": 1, "front_cpu": {"per_request_s": f, "per_token_s": p}})
    t = _step_s(sim, ChunkShape(0, len(IDS)))
    d = _step_s(sim, ChunkShape(len(IDS), 1))
    assert f < t and p < d
    (record,) = sim.run([BenchRequest(IDS, 2, 0.0)])
    t1, t2 = record.token_times_s
    assert t1 == pytest.approx(t + f)
    assert t2 - t1 == pytest.approx(d + p)
    assert sim.host_load.work_s() == pytest.approx({"front": f + 2 * p})
    # The worker's own work is not changed, only stretched.
    assert sim.workers["colocated-0"].work_time_s == pytest.approx(t + d)


def test_front_and_client_are_two_busy_threads():
    """Front and client each F at arrival, one core, three threads at 1/3 speed until 3F;
    the step (T) then has T - F left alone: first token at T + 2F. With two cores the three
    run at 2/3 until 1.5F: T + F / 2."""
    f = 0.003
    host = {"front_cpu": {"per_request_s": f}, "client_cpu": {"per_request_s": f}}
    sim = _sim(COLOCATED, {"cores": 1, **host})
    t = _step_s(sim, ChunkShape(0, len(IDS)))
    (record,) = sim.run([BenchRequest(IDS, 1, 0.0)])
    assert record.token_times_s[0] == pytest.approx(t + 2 * f)
    sim = _sim(COLOCATED, {"cores": 2, **host})
    (record,) = sim.run([BenchRequest(IDS, 1, 0.0)])
    assert record.token_times_s[0] == pytest.approx(t + f / 2)


def test_spare_cores_leave_the_run_bit_equal_and_count_the_work():
    """Enough cores for every thread: the background work slows nothing, so the summary is
    bit-equal to a run without it, and the work given is per request / token / handoff."""
    reqs = [BenchRequest(IDS[: 64 + 8 * i], 3 + i % 4, 0.01 * i) for i in range(12)]
    costs = {"front_cpu": {"per_request_s": 1e-3, "per_token_s": 2e-4, "per_handoff_s": 5e-4},
             "client_cpu": {"per_request_s": 7e-4, "per_token_s": 1e-4}}
    base = _sim(PD, {"cores": 16})
    records = base.run(reqs)
    loaded = _sim(PD, {"cores": 16, **costs})
    loaded_records = loaded.run(reqs)
    assert [r.token_times_s for r in loaded_records] == [r.token_times_s for r in records]
    tokens = sum(r.output_len for r in reqs)
    assert loaded.host_load.work_s() == pytest.approx({
        "front": 12 * 1e-3 + tokens * 2e-4 + 12 * 5e-4,
        "client": 12 * 7e-4 + tokens * 1e-4})
    # Zero costs are the same as none.
    zero = _sim(PD, {"cores": 2, "front_cpu": {}, "client_cpu": {},
                     "kv_transfer_cpu_s_per_gb": {"sender": 0, "receiver": 0}})
    none = _sim(PD, {"cores": 2})
    assert ([r.token_times_s for r in zero.run(reqs)]
            == [r.token_times_s for r in none.run(reqs)])


def test_a_transfer_charges_both_ends_and_waits_for_their_cpu():
    """The link is fast (its floor ~0), so the transfer lands when both ends' CPU is done:
    S·GB at full speed with spare cores; with one core the two ends share it (2·S·GB)."""
    per_gb = 2.0
    costs = {"kv_transfer_cpu_s_per_gb": {"sender": per_gb, "receiver": per_gb / 2}}
    link = {"kv_transfer": {"bandwidth_gb_s": 1e6, "latency_ms": 0.0}}
    gaps = {}
    for cores in (8, 1):
        sim = _sim(PD, {"cores": cores, **costs}, **link)
        (record,) = sim.run([BenchRequest(IDS, 2, 0.0)])
        gb = sim.transfer_bytes / 1e9
        assert sim.num_transfers == 1 and gb > 0
        assert sim.host_load.work_s() == pytest.approx(
            {"kv-send:prefill-0": per_gb * gb, "kv-recv:decode-0": per_gb / 2 * gb})
        d = _step_s(sim, ChunkShape(len(IDS), 1))
        gaps[cores] = record.token_times_s[1] - record.token_times_s[0] - d
    assert gaps[8] == pytest.approx(per_gb * gb)
    # One core: both ends at half speed until the receiver's S/2·GB is done at S·GB, then the
    # sender's remaining S/2·GB alone.
    assert gaps[1] == pytest.approx(1.5 * per_gb * gb)


def test_the_link_stays_the_floor():
    """Cheap CPU, slow link: the transfer takes the link's time, as without CPU costs."""
    link = {"kv_transfer": {"bandwidth_gb_s": 0.05, "latency_ms": 3.0}}
    reqs = [BenchRequest(IDS, 2, 0.0)]
    with_cpu = _sim(PD, {"cores": 8, "kv_transfer_cpu_s_per_gb": {"sender": 1e-3}}, **link)
    without = _sim(PD, {"cores": 8}, **link)
    (a,), (b,) = with_cpu.run(reqs), without.run(reqs)
    assert a.token_times_s == pytest.approx(b.token_times_s)
    assert with_cpu.host_load.work_s()["kv-send:prefill-0"] > 0


def test_loaded_run_finishes_everything_with_invariants_checked():
    reqs = [BenchRequest(IDS[: 32 + 7 * i], 2 + i % 5, 0.005 * i) for i in range(16)]
    host = {"cores": 1, "front_cpu": {"per_request_s": 2e-3, "per_token_s": 3e-4,
                                      "per_handoff_s": 1e-3},
            "client_cpu": {"per_request_s": 1e-3, "per_token_s": 2e-4},
            "kv_transfer_cpu_s_per_gb": {"sender": 0.8, "receiver": 0.6}}
    for sharing in ("fair", "at-start"):
        base = _sim({"prefill": {"workers": 2}, "decode": {"workers": 2}},
                    {"cores": 1, "sharing": sharing})
        base_records = base.run(reqs)
        sim = _sim({"prefill": {"workers": 2}, "decode": {"workers": 2}},
                   {**host, "sharing": sharing})
        records = sim.run(reqs)
        assert all(r.error is None and len(r.token_times_s) == r.output_len for r in records)
        assert all(not job.busy for job in sim.host_load.jobs.values())
        assert sim.num_transfers == len(reqs)
        # More CPU on the same cores: the run ends later than without it.
        assert max(r.finished_s for r in records) > max(r.finished_s for r in base_records)


@pytest.mark.parametrize("host, match", [
    ({"front_cpu": {"per_request_s": 1e-3}}, "need host.cores"),
    ({"cores": 2, "front_cpu": {"per_req": 1e-3}}, "unknown keys"),
    ({"cores": 2, "client_cpu": {"per_handoff_s": 1e-3}}, "unknown keys"),
    ({"cores": 2, "front_cpu": {"per_token_s": -1.0}}, "per_token_s"),
    ({"cores": 2, "kv_transfer_cpu_s_per_gb": 0.5}, "sender"),
    ({"cores": 2, "kv_transfer_cpu_s_per_gb": {"sender": -1}}, "kv_transfer_cpu_s_per_gb"),
    ({"cores": 2, "client_cpu": {"per_token_s": "fast"}}, "client_cpu.per_token_s must be"),
])
def test_bad_host_cpu_keys_are_clear_errors(host, match):
    with pytest.raises(ValueError, match=match):
        cluster_from_dict({"cost": {"profile": PROFILE}, "pools": COLOCATED, "host": host})


def test_absent_host_cpu_is_none():
    spec = cluster_from_dict({"cost": {"profile": PROFILE}, "pools": COLOCATED,
                              "host": {"cores": 2}})
    assert spec.host_cpu is None
    assert ClusterSimulator(spec).host_load is None


# ---- benchmarks/sim_validation_calibration.py: the measured costs into a cluster ----------
def _calibration_module():
    import importlib.util
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "sim_validation_calibration", root / "benchmarks" / "sim_validation_calibration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calibration_fit_separates_per_request_and_per_token():
    calib = _calibration_module()
    # 32 requests: 0.1 s + 256 tokens, then 0.1 s + 2048 tokens at 0.1 ms each.
    per_request, per_token = calib._fit_two([(32, 256, 0.1 + 256e-4), (32, 2048, 0.1 + 2048e-4)])
    assert per_token == pytest.approx(1e-4)
    assert per_request == pytest.approx(0.1 / 32)
    # A cost that falls with more tokens (clock-tick noise) is clipped, not negative.
    assert calib._fit_two([(32, 256, 0.2), (32, 2048, 0.19)])[1] == 0.0


def test_calibration_and_profile_give_the_clusters_host_keys(tmp_path):
    import json
    calib = _calibration_module()
    profile = tmp_path / "profile.json"
    data = json.loads(Path(PROFILE).read_text())
    data["metadata"]["kv_transport"] = {"bandwidth_gb_s": 0.7, "latency_ms": 0.0,
                                        "cpu_s_per_gb": {"sender": 0.8, "receiver": 0.5}}
    profile.write_text(json.dumps(data))
    shape = {"front_cpu": {"per_request_s": 4e-3, "per_token_s": 1e-4},
             "client_cpu": {"per_request_s": 3e-3, "per_token_s": 9e-5}}
    pd_shape = {k: {n: 2 * v for n, v in c.items()} for k, c in shape.items()}
    calib.use_calibration({"colocated": shape, "pd": pd_shape})
    keys = calib.host_cpu_keys(str(profile), PD)
    assert keys == {**pd_shape, "kv_transfer_cpu_s_per_gb": {"sender": 0.8, "receiver": 0.5}}
    assert calib.host_cpu_keys(str(profile), COLOCATED)["front_cpu"] == shape["front_cpu"]
    spec = cluster_from_dict({"cost": {"profile": str(profile)}, "pools": PD,
                              "host": {"cores": 2, **keys}})
    assert spec.host_cpu.kv_send_s_per_gb == 0.8 and spec.host_cpu.front.per_token_s == 2e-4
    calib.use_calibration(None)  # a profile without CPU costs adds nothing
    assert calib.host_cpu_keys(PROFILE, PD) == {}
    calib.use_calibration(None, enabled=False)
    assert calib.host_cpu_keys(str(profile), PD) == {}


def test_calibration_splits_the_pd_fronts_extra_per_request_into_its_handoff():
    calib = _calibration_module()

    def runs(front_per_request, front_per_token):
        return [{"requests": 32, "tokens": t, "client_cpu_s": 32 * 3e-3 + t * 1e-4,
                 "front_cpu_s": 32 * front_per_request + t * front_per_token}
                for t in (256, 2048)]
    costs = calib.costs_from_runs(runs(3e-3, 1e-4), runs(7e-3, 2.5e-4))
    assert costs["colocated"]["front_cpu"] == pytest.approx(
        {"per_request_s": 3e-3, "per_token_s": 1e-4})
    assert costs["pd"]["front_cpu"] == pytest.approx(
        {"per_request_s": 3e-3, "per_token_s": 2.5e-4, "per_handoff_s": 4e-3})
    assert costs["pd"]["client_cpu"] == pytest.approx(
        {"per_request_s": 3e-3, "per_token_s": 1e-4})


def test_the_report_sets_the_simulated_other_cpu_beside_the_measured():
    from types import SimpleNamespace
    calib = _calibration_module()
    sim = _sim(PD, {"cores": 2, "front_cpu": {"per_request_s": 1e-3},
                    "kv_transfer_cpu_s_per_gb": {"sender": 1.0, "receiver": 0.5}})
    sim.run([BenchRequest(IDS, 2, 0.0)])
    out = calib.simulated_host_cpu(SimpleNamespace(simulator=sim))
    assert out == pytest.approx({"front": 1e-3, "client": 0.0,
                                 "kv_transfers": 1.5 * sim.transfer_bytes / 1e9})
    assert calib.format_host_cpu(out).startswith("  simulated other CPU s: front 0.00")
    assert calib.simulated_host_cpu(SimpleNamespace(simulator=_sim(PD, None))) is None


def test_prefill_cpu_per_handoff_is_the_prefill_workers_own_work():
    """A P/D prefill worker's handoff path costs it `per_handoff_s` more work per handed-off
    request (charged to its next step, like publishing); a request that finishes with its
    first token is not handed off and costs nothing extra."""
    c = 0.05
    base = _sim(PD, {"cores": 2})
    with_cost = _sim(PD, {"cores": 2, "prefill_cpu": {"per_handoff_s": c}})
    requests = [BenchRequest(IDS, 3, 0.0), BenchRequest(IDS[::-1], 3, 0.5),
                BenchRequest(IDS[:64], 1, 1.0)]
    base.run(requests)
    with_cost.run(requests)
    extra = with_cost.workers["prefill-0"].work_time_s - base.workers["prefill-0"].work_time_s
    assert extra == pytest.approx(2 * c)
    assert with_cost.workers["decode-0"].work_time_s == pytest.approx(
        base.workers["decode-0"].work_time_s)
    for bad in ({"per_handoff_s": -1.0}, {"per_request_s": 0.1}, [0.1]):
        with pytest.raises(ValueError, match="prefill_cpu"):
            _sim(PD, {"cores": 2, "prefill_cpu": bad})
