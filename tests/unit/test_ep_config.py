"""EPLB / parallel settings: vLLM-shaped flags, bad values are one-line CLI errors (exit 2)
before any process starts."""
from __future__ import annotations

import pytest

from deepinfer.cli.main import main
from deepinfer.ep.ep_config import EPConfig
from deepinfer.moe.eplb_config import EPLBConfig


def test_eplb_config_from_json():
    cfg = EPLBConfig.from_json('{"window_size": 8, "step_interval": 4, "num_redundant_experts": 2}')
    assert (cfg.window_size, cfg.step_interval, cfg.num_redundant_experts) == (8, 4, 2)
    assert EPLBConfig.from_json(None) == EPLBConfig()
    for bad, match in (("{", "JSON"), ("[1]", "object"), ('{"window": 1}', "unknown"),
                       ('{"window_size": "8"}', "int"), ('{"step_interval": 0}', ">= 1"),
                       ('{"num_redundant_experts": -1}', ">= 0"),
                       ('{"window_size": true}', "int")):
        with pytest.raises(ValueError, match=match):
            EPLBConfig.from_json(bad)


def test_ep_config_checks():
    assert not EPConfig().is_parallel
    assert EPConfig(data_parallel_size=2).is_parallel
    with pytest.raises(ValueError, match="needs --enable-expert-parallel"):
        EPConfig(enable_eplb=True)
    with pytest.raises(ValueError, match="all2all"):
        EPConfig(dispatcher="nccl-magic")
    with pytest.raises(ValueError):
        EPConfig(data_parallel_size=0)


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel-size", "2", "--enable-eplb"], "needs --enable-expert-parallel"),
    (["--data-parallel-size", "2", "--enable-expert-parallel", "--enable-eplb",
      "--eplb-config", "{oops"], "not valid JSON"),
    (["--data-parallel-size", "2", "--eplb-config", "{}"], "needs --enable-eplb"),
    (["--data-parallel-size", "2", "--enable-expert-parallel"], "needs a MoE model"),
    (["--data-parallel-size", "0"], "must be >= 1"),
])
def test_serve_flag_errors_exit_2_with_one_line(flags, message, capsys):
    assert main(["serve", "--port", "1", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cuda_ranks_pick_nccl_with_a_gloo_step_header(monkeypatch):
    """NCCL cannot run on this machine (no GPU): this checks the choice the CUDA path makes.
    A rank on a CUDA device initialises NCCL (bound to its device) and a gloo group for the
    step header; a CPU rank uses gloo for both."""
    import torch
    import torch.distributed as dist

    from deepinfer.ep import process_group
    from deepinfer.moe.dispatch import AllToAllDispatcher, make_dispatcher
    calls = []
    monkeypatch.setattr(process_group, "_rendezvous_store",
                        lambda rank, world, host, port, timeout: ("store", rank, host, port))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw.get("device_id")))
                        if kw["store"][0] == "store" else None)
    monkeypatch.setattr(dist, "new_group", lambda backend, **kw: calls.append(("group", backend))
                        or "gloo-group")
    group = process_group.init_rank_group(1, 2, 12345, torch.device("cuda", 1), None, 5.0)
    assert calls == [("init", "nccl", torch.device("cuda", 1)), ("group", "gloo")]
    assert group.control_group == "gloo-group"
    calls.clear()
    group = process_group.init_rank_group(0, 2, 12345, torch.device("cpu"), None, 5.0)
    assert calls == [("init", "gloo", None)] and group.control_group is None
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert isinstance(make_dispatcher("alltoall", 1, 2, 4), AllToAllDispatcher)
