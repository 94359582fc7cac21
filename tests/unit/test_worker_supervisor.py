"""Restart policy of lost cluster workers: back-off schedule, give-up limit, outage records."""
from __future__ import annotations

import pytest

from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.cluster.worker_supervisor import RestartPolicy, WorkerState, WorkerSupervisor

POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, max_restarts=5,
                       stable_after_s=60.0, ready_timeout_s=100.0)


def test_backoff_doubles_up_to_the_cap():
    assert [POLICY.backoff_s(k) for k in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert POLICY.backoff_s(10_000) == 4.0  # no overflow for a long-flapping worker
    with pytest.raises(ValueError):
        POLICY.backoff_s(0)


def fail_restart(sup: WorkerSupervisor, worker_id: str, now: float) -> float:
    """Start the due restart of `worker_id` at `now` and lose it again; returns the delay."""
    assert sup.due(now) == [worker_id]
    sup.on_started(worker_id, now)
    decision = sup.on_lost(worker_id, "restarted process exited (1)", now + 1.0)
    return None if decision.gave_up else decision.restart_at - (now + 1.0)


def test_crash_looping_worker_backs_off_then_gives_up():
    sup = WorkerSupervisor(POLICY)
    sup.add_worker("prefill-0", "prefill", now=0.0)
    first = sup.on_lost("prefill-0", "process exited (-9)", now=10.0)
    assert first.restart_at == 10.5 and not first.gave_up
    assert sup.due(10.4) == [] and sup.state("prefill-0") is WorkerState.BACKOFF
    now, delays = 10.5, []
    while (delay := fail_restart(sup, "prefill-0", now)) is not None:
        delays.append(delay)
        now += 1.0 + delay
    assert delays == [1.0, 2.0, 4.0, 4.0]  # restarts 2..5, then the 6th loss gives up
    assert sup.state("prefill-0") is WorkerState.GAVE_UP
    assert sup.num_restarts["prefill"] == 5 and sup.num_gave_up["prefill"] == 1
    assert sup.due(now + 1e6) == []  # never again
    record = sup.records[-1]
    assert record.gave_up and record.num_attempts == 5 and record.recovery_s is None


def test_readmission_records_recovery_time_and_a_stable_worker_starts_over():
    sup = WorkerSupervisor(POLICY)
    sup.add_worker("decode-0", "decode", now=0.0)
    sup.add_worker("decode-1", "decode", now=0.0)
    sup.on_lost("decode-1", "missed heartbeats", now=5.0)
    sup.on_lost("decode-1", "process exited (-9)", now=5.1)  # the same outage, reported twice
    assert sup.due(5.5) == ["decode-1"]
    sup.on_started("decode-1", 5.5)
    assert sup.state("decode-1") is WorkerState.STARTING and sup.due(100.0) == []
    outage = sup.on_admitted("decode-1", now=9.0)
    assert outage.recovery_s == pytest.approx(4.0) and outage.reason == "missed heartbeats"
    assert sup.num_restarts == {"decode": 1}
    # Lost again soon after: the second restart in a row waits longer.
    assert sup.on_lost("decode-1", "process exited (-9)", now=20.0).restart_at == 21.0
    sup.on_started("decode-1", 21.0)
    sup.on_admitted("decode-1", 25.0)
    # After a stable minute, a loss is a first loss again.
    assert sup.on_lost("decode-1", "process exited (-9)", now=25.0 + 61.0).restart_at == 86.5
    assert sup.state("decode-0") is WorkerState.ALIVE


def test_a_replacement_that_never_becomes_ready_is_overdue():
    sup = WorkerSupervisor(POLICY)
    sup.add_worker("prefill-1", "prefill", now=0.0)
    sup.on_lost("prefill-1", "worker failed", now=1.0)
    sup.on_started("prefill-1", 1.5)
    assert sup.start_overdue(101.0) == [] and sup.start_overdue(101.6) == ["prefill-1"]
    with pytest.raises(ValueError):
        sup.on_started("prefill-1", 2.0)  # already starting


def test_zero_restarts_means_never_restart():
    sup = WorkerSupervisor(RestartPolicy(max_restarts=0))
    sup.add_worker("decode-0", "decode", now=0.0)
    assert sup.on_lost("decode-0", "process exited (-9)", now=1.0).gave_up
    assert sup.due(1e9) == [] and sup.num_restarts["decode"] == 0


@pytest.mark.parametrize("kwargs", [dict(initial_backoff_s=-1.0), dict(max_backoff_s=0.1),
                                    dict(multiplier=0.5), dict(max_restarts=-1),
                                    dict(ready_timeout_s=0.0)])
def test_bad_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)


def test_cluster_config_carries_the_policy():
    config = ClusterConfig(max_worker_restarts=3, restart_backoff_s=1.0, restart_backoff_max_s=8.0)
    assert config.restart_policy.backoff_s(5) == 8.0 and config.restart_policy.max_restarts == 3
    with pytest.raises(ValueError):
        ClusterConfig(restart_backoff_s=10.0, restart_backoff_max_s=1.0)


def test_serve_flag_bounds_worker_restarts():
    import argparse
    import asyncio

    from deepinfer.cli.serve import register
    from deepinfer.clients.factory import client_from_args

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--prefill-workers", "1", "--decode-workers", "1",
                              "--kv-store", "none", "--max-engine-restarts", "2"])
    client = client_from_args(args, engine_config=None)  # binds a socket, no workers
    try:
        assert client.supervisor.policy.max_restarts == 2
    finally:
        asyncio.run(client.shutdown())


class _Proc:
    def __init__(self, alive: bool, exitcode=None) -> None:
        self.alive, self.exitcode, self.killed = alive, exitcode, False

    def is_alive(self) -> bool:
        return self.alive

    def kill(self) -> None:
        self.killed, self.alive = True, False


def test_drive_restarts_one_pass_over_overdue_exited_and_due_workers():
    from deepinfer.cluster.worker_supervisor import drive_restarts
    sup = WorkerSupervisor(RestartPolicy(max_restarts=3, initial_backoff_s=1.0,
                                         max_backoff_s=1.0, ready_timeout_s=10.0))
    for w in ("slow", "crashed", "waiting", "fine"):
        sup.add_worker(w, "prefill", now=0.0)
        sup.on_lost(w, "killed", now=100.0)
    sup.on_started("slow", now=101.0)  # not ready 11 s later: overdue
    for w in ("crashed", "fine"):  # still within their 10 s to become ready at 112
        sup.on_started(w, now=110.0)
    procs = {"slow": _Proc(alive=True), "crashed": _Proc(alive=False, exitcode=-9),
             "fine": _Proc(alive=True), "waiting": None}
    lost, restarted = [], []

    def lose(w, reason):
        lost.append((w, reason))
        sup.on_lost(w, reason, now=112.0)
    drive_restarts(sup, 112.0, procs.get, lose, restarted.append)
    assert procs["slow"].killed and not procs["fine"].killed
    assert lost == [("slow", "restarted worker not ready after 10 s"),
                    ("crashed", "restarted process exited (-9)")]
    assert restarted == ["waiting"]  # due since 101; the two just lost wait their back-off
    assert sup.state("fine") is WorkerState.STARTING
