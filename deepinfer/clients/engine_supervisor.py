"""Restarts the colocated engine process when it dies, with back-off.

    RUNNING ──engine dies──▶ DOWN: in-flight requests fail (500 engine_dead), new ones get
       ▲                     503, /health is 503
       │                       │ wait initial_backoff_s · multiplier^(k-1) (capped)
       └── first healthy ◀── spawn a new engine, wait for EngineReady + its first report
           report              (fails: k += 1; k > max_restarts: give up, stay DOWN)

An engine that stayed up for `stable_after_s` starts over at k = 1, so one killed once a day
is restarted promptly every time, while one that crashes at load is retried a bounded number
of times. The client does the process work (`ColocatedClient.wait_dead`, `restart_engine`); the
decisions are the cluster workers' (`cluster.worker_supervisor.WorkerSupervisor`), so the engine,
prefill / decode / encode workers and EP groups follow one state machine over one policy.
"""
from __future__ import annotations

import asyncio
import logging
import time

from deepinfer.cluster.worker_supervisor import WorkerState, WorkerSupervisor
from deepinfer.core.restart_policy import RestartPolicy

logger = logging.getLogger(__name__)


# The one restart policy of every supervisor; the old name stays for existing callers.
EngineRestartPolicy = RestartPolicy


class EngineSupervisor:
    """A task of the front: each time the client's engine dies, restart it after a back-off.
    `client` provides `wait_dead()` (awaits the death) and `restart_engine()` (spawn, wait
    until healthy; raises on failure). When to restart and when to give up is decided by the
    same `WorkerSupervisor` state machine the cluster's workers are supervised by (one
    entry, "engine"); this task only sleeps until the decision is due and acts on it."""

    WORKER_ID = "engine"

    def __init__(self, client, policy: EngineRestartPolicy) -> None:
        self.client = client
        self.policy = policy
        self.state = WorkerSupervisor(policy)
        self._task: asyncio.Task | None = None

    @property
    def gave_up(self) -> bool:
        return self.state.state(self.WORKER_ID) is WorkerState.GAVE_UP

    def start(self) -> None:
        self.state.add_worker(self.WORKER_ID, "engine", time.monotonic())
        if self.policy.max_restarts > 0:
            self._task = asyncio.create_task(self._run(), name="engine-supervisor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        reason = "engine died"
        while True:
            if self.state.state(self.WORKER_ID) is WorkerState.ALIVE:
                await self.client.wait_dead()
                reason = "engine died"
            decision = self.state.on_lost(self.WORKER_ID, reason, time.monotonic())
            if decision.gave_up:
                logger.error("engine: giving up after %d consecutive restarts",
                             self.policy.max_restarts)
                return
            delay = max(0.0, decision.restart_at - time.monotonic())
            logger.warning("engine died; restart %d in %.1f s", decision.num_consecutive, delay)
            await asyncio.sleep(delay)
            started = time.monotonic()
            self.state.on_started(self.WORKER_ID, started)
            try:
                await self.client.restart_engine()
            except Exception as e:  # failed to come up: lost again, back off further
                reason = f"restart failed: {str(e).strip().splitlines()[-1:] or e}"
                logger.error("engine restart %d failed: %s", decision.num_consecutive, reason)
                continue
            self.state.on_admitted(self.WORKER_ID, time.monotonic())
            logger.warning("engine restarted in %.1f s; re-admitting traffic",
                           time.monotonic() - started)
