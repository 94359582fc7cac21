"""Small decode steps slow while another worker steps on another core (`sim.memory_contention`,
`host.memory_contention`): the hand-computed arithmetic with two workers, no effect without the
key, and the checks on the numbers. Pure and fast."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.bench.workloads import BenchRequest
from deepinfer.cli.main import main
from deepinfer.core.cost_model import ChunkShape
from deepinfer.sim import ClusterSimulator, cluster_from_dict
from deepinfer.sim.memory_contention import MemoryContention, memory_contention_from_dict

PROFILE = str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
              / "cost_profile_smollm2_bf16_cpu_1thread.json")
IDS = list(range(1000, 1128))
CONTENTION = {"decode_with_decode": 0.5, "decode_with_prefill": 0.8}


def _sim(contention=None, cores=2, sharing="fair", pools=None) -> ClusterSimulator:
    host = {"cores": cores, "sharing": sharing} if cores is not None else {}
    if contention is not None:
        host["memory_contention"] = contention
    return ClusterSimulator(cluster_from_dict({
        "cost": {"profile": PROFILE}, "engine": {"num_kv_blocks": 256},
        "pools": pools or {"colocated": {"workers": 2}},
        "routers": {"prefill": "round-robin"}, "host": host}))


def _time(sim: ClusterSimulator, chunks) -> float:
    return sim.workers["colocated-0"].step_model.step_time_s(chunks)


@pytest.mark.parametrize("cores,sharing", [(2, "fair"), (2, "at-start"), (None, "fair")])
def test_two_decode_steps_at_once_advance_at_the_factor(cores, sharing):
    """One-token prompts: each worker's only step is a 1-row decode of work t. a runs alone
    from 0 to d, then both at 0.5: a's t - d takes 2(t - d), so a ends at 2t - d; b did
    t - d of its work by then and runs its last d alone: it ends at 2t. Both wait 2t - d;
    both cost d + (t - d) / 0.5 = 2t - d CPU seconds for work t."""
    sim = _sim(CONTENTION, cores, sharing)
    t = _time(sim, [ChunkShape(0, 1)])
    d = 0.25 * t
    a, b = sim.run([BenchRequest(IDS[:1], 1, 0.0), BenchRequest(IDS[1:2], 1, d)])
    assert {a.prefill_worker, b.prefill_worker} == {"colocated-0", "colocated-1"}
    assert a.token_times_s[0] - a.arrival_s == pytest.approx(2 * t - d)
    assert b.token_times_s[0] - b.arrival_s == pytest.approx(2 * t - d)
    assert [w.work_time_s for w in sim.workers.values()] == pytest.approx([t, t])
    assert list(sim.cpu_time_s.values()) == pytest.approx([2 * t - d, 2 * t - d])


def test_decode_next_to_a_prefill_uses_the_prefill_factor_and_the_prefill_is_unaffected():
    sim = _sim(CONTENTION)
    t_dec, t_pre = _time(sim, [ChunkShape(0, 1)]), _time(sim, [ChunkShape(0, len(IDS))])
    assert t_pre > t_dec / 0.8  # the decode ends while the prefill still runs
    a, b = sim.run([BenchRequest(IDS[:1], 1, 0.0), BenchRequest(IDS, 1, 0.0)])
    assert a.token_times_s[0] == pytest.approx(t_dec / 0.8)
    assert b.token_times_s[0] == pytest.approx(t_pre)
    cpu = sim.cpu_time_s
    assert cpu[a.prefill_worker] == pytest.approx(t_dec / 0.8)
    assert cpu[b.prefill_worker] == pytest.approx(t_pre)


def test_absent_key_runs_the_same_and_factors_of_one_change_no_token_time():
    """A P/D run: without the key nothing changes (the run is deterministic bit for bit);
    with factors 1.0 the same token times; with real factors decode gets slower."""
    pools = {"prefill": {"workers": 2}, "decode": {"workers": 2}}
    requests = [BenchRequest(IDS[i:i + 40], 12, 0.01 * i) for i in range(8)]

    def run(contention):
        sim = _sim(contention, pools=pools)
        return sim, [(r.token_times_s, r.decode_worker) for r in sim.run(list(requests))]

    base_sim, base = run(None)
    assert base_sim.memory_contention is None
    assert run(None)[1] == base
    ones_sim, ones = run({"decode_with_decode": 1.0, "decode_with_prefill": 1.0})
    assert ones == base
    assert list(ones_sim.cpu_time_s.values()) == pytest.approx(list(base_sim.cpu_time_s.values()))
    slow_sim, slow = run(CONTENTION)
    assert slow[-1][0][-1] > base[-1][0][-1]
    assert sum(slow_sim.cpu_time_s.values()) > sum(base_sim.cpu_time_s.values())


@pytest.mark.parametrize("value", [
    {"decode_with_decode": 0.0, "decode_with_prefill": 0.9},
    {"decode_with_decode": 1.2, "decode_with_prefill": 0.9},
    {"decode_with_decode": True, "decode_with_prefill": 0.9},
    {"decode_with_decode": "0.8", "decode_with_prefill": 0.9},
    {"decode_with_decode": 0.8},
    {"decode_with_decode": 0.8, "decode_with_prefill": 0.9, "prefill_with_decode": 0.9},
    "sometimes", 0.8])
def test_bad_values_are_rejected(value):
    with pytest.raises(ValueError, match="memory_contention"):
        _sim(value)


def test_measured_needs_the_profile_measurement():
    with pytest.raises(ValueError, match="--memory-contention"):
        _sim("measured")


def test_profile_metadata_keeps_only_the_numbers():
    mc = memory_contention_from_dict({"decode_with_decode": 0.8, "decode_with_prefill": 0.97,
                                      "method": "x", "rounds": {}}, small_decode_rows=4)
    assert mc == MemoryContention(0.8, 0.97, small_decode_rows=4)
    assert mc.efficiency("decode", ["prefill", "decode"]) == 0.8
    assert mc.efficiency("decode", ["prefill"]) == 0.97
    assert mc.efficiency("decode", []) == 1.0
    assert mc.efficiency("prefill", ["decode"]) == 1.0
    assert mc.efficiency("large_decode", ["decode"]) == 1.0
    assert mc.kind([ChunkShape(10, 1)] * 5) == "large_decode"


def test_measured_reads_the_profile_and_checks_it(tmp_path):
    data = json.loads(Path(PROFILE).read_text())
    data["metadata"]["memory_contention"] = {"decode_with_decode": 0.8,
                                             "decode_with_prefill": 0.95, "method": "test"}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    sim = ClusterSimulator(cluster_from_dict({
        "cost": {"profile": str(path)}, "pools": {"colocated": {"workers": 2}},
        "host": {"memory_contention": "measured"}}))
    assert (sim.memory_contention.decode_with_decode,
            sim.memory_contention.decode_with_prefill) == (0.8, 0.95)
    data["metadata"]["memory_contention"]["decode_with_decode"] = 1.3
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        ClusterSimulator(cluster_from_dict({
            "cost": {"profile": str(path)}, "pools": {"colocated": {"workers": 2}},
            "host": {"memory_contention": "measured"}}))


def test_profile_update_names_the_flag(tmp_path, capsys):
    assert main(["profile", "--update", PROFILE, "--out", str(tmp_path / "o.json")]) == 2
    assert "--memory-contention" in capsys.readouterr().err


@pytest.mark.slow  # loads the model in two more processes
def test_measure_memory_contention_restores_affinity_and_threads(make_engine_llm):
    """The real measurement, as short as it goes: positive ratios from one round each, and the
    process's core affinity and torch threads are what they were."""
    import os

    import torch

    from deepinfer.bench.host_contention import measure_memory_contention

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    llm = make_engine_llm(num_kv_blocks=128)
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    out = measure_memory_contention(llm.engine.runner, llm.engine.model_config.vocab_size,
                                    {"dtype": "float32", "device": "cpu", "num_threads": 1,
                                     "num_kv_blocks": 128}, cpu_s=0.05, repeats=1)
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads
    for key in ("decode_with_decode", "decode_with_prefill"):
        assert 0 < out[key] < 2
    assert len(out["rounds"]["decode"]) == 1 and len(out["cores"]) == 2
