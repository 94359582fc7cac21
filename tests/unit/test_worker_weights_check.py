"""Workers that loaded other model files never join a cluster: their KV has the same shapes
as everyone else's, so a hand-off (or a shared store block) between them would be a silently
wrong answer (e.g. `--model` naming a path that holds other files on another Ray machine).
The front compares each worker's weights fingerprint (in its `WorkerReady`) with the
cluster's: at start-up a mismatch fails the start with a clear error; a restarted or added
worker that differs is killed and counted lost, never routed to."""
from __future__ import annotations

import pytest

from deepinfer.wire.worker_messages import WorkerReady
from deepinfer.cluster.worker_supervisor import WorkerState
from deepinfer.engine.exceptions import EngineDeadError
from deepinfer.wire import TokenizerFiles
from tests.unit.test_disagg_client_faults import BLOCK, run_front


def ready(worker_id: str, role: str, fingerprint: str, pid: int = 0) -> WorkerReady:
    return WorkerReady(worker_id, role, pid, None, "m", 4096, 1000, BLOCK, 64, 16, TokenizerFiles(),
                       weights_fingerprint=fingerprint)


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid, self.killed = pid, False

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True


def test_a_worker_with_other_weights_never_joins():
    async def test(client, workers):
        assert await client._on_startup_message(ready("p0", "prefill", "a" * 32)) == "p0"
        assert await client._on_startup_message(ready("d0", "decode", "a" * 32)) == "d0"
        with pytest.raises(EngineDeadError, match="d1 loaded other model files"):
            await client._on_startup_message(ready("d1", "decode", "b" * 32))

        # p1 is lost and restarted; the new process serves other files.
        handle = client.workers["p1"]
        handle.alive, handle.ready, handle.proc = False, None, FakeProc(4321)
        client.supervisor.on_lost("p1", "killed", 0.0)
        client.supervisor.on_started("p1", 0.0)
        client.health.on_restart_ready(ready("p1", "prefill", "b" * 32, pid=4321))
        assert handle.ready is None and handle.proc.killed
        assert client.supervisor.state("p1") is not WorkerState.STARTING
        assert "p1" not in {ld.worker_id for ld in client._loads("prefill")}

        # The same files again: it is ready (routed after its first report).
        handle.proc = FakeProc(4322)
        client.supervisor.on_started("p1", 0.0)
        client.health.on_restart_ready(ready("p1", "prefill", "a" * 32, pid=4322))
        assert handle.ready is not None and not handle.proc.killed

    run_front(test, max_worker_restarts=3)


def test_a_worker_that_reports_no_fingerprint_never_joins():
    async def test(client, workers):
        assert await client._on_startup_message(ready("p0", "prefill", "a" * 32)) == "p0"
        with pytest.raises(EngineDeadError, match="d0 reported no weights fingerprint"):
            await client._on_startup_message(ready("d0", "decode", ""))

    run_front(test, max_worker_restarts=3)
