"""Restarts the colocated engine process when it dies, with back-off.

    RUNNING ──engine dies──▶ DOWN: in-flight requests fail (500 engine_dead), new ones get
       ▲                     503, /health is 503
       │                       │ wait initial_backoff_s · multiplier^(k-1) (capped)
       └── first healthy ◀── spawn a new engine, wait for EngineReady + its first report
           report              (fails: k += 1; k > max_restarts: give up, stay DOWN)

An engine that stayed up for `stable_after_s` starts over at k = 1, so one killed once a day
is restarted promptly every time, while one that crashes at load is retried a bounded number
of times. The client does the process work (`ColocatedClient.wait_dead`, `restart_engine`); this
module only decides when.
"""
from __future__ import annotations

import asyncio
import logging
import time

from deepinfer.core.restart_policy import RestartPolicy

logger = logging.getLogger(__name__)


# The one restart policy of every supervisor; the old name stays for existing callers.
EngineRestartPolicy = RestartPolicy


class EngineSupervisor:
    """A task of the front: each time the client's engine dies, restart it after a back-off.
    `client` provides `wait_dead() -> float` (awaits the death, returns how long the engine had
    been healthy) and `restart_engine()` (spawn, wait until healthy; raises on failure)."""

    def __init__(self, client, policy: EngineRestartPolicy) -> None:
        self.client = client
        self.policy = policy
        self.gave_up = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.policy.max_restarts > 0:
            self._task = asyncio.create_task(self._run(), name="engine-supervisor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        attempt = 0
        while True:
            uptime_s = await self.client.wait_dead()
            if uptime_s >= self.policy.stable_after_s:
                attempt = 0
            while True:
                attempt += 1
                if attempt > self.policy.max_restarts:
                    self.gave_up = True
                    logger.error("engine: giving up after %d consecutive restarts",
                                 self.policy.max_restarts)
                    return
                delay = self.policy.backoff_s(attempt)
                logger.warning("engine died; restart %d in %.1f s", attempt, delay)
                await asyncio.sleep(delay)
                started = time.monotonic()
                try:
                    await self.client.restart_engine()
                except Exception as e:  # failed to come up: back off further
                    logger.error("engine restart %d failed: %s", attempt,
                                 str(e).strip().splitlines()[-1:] or e)
                    continue
                logger.warning("engine restarted in %.1f s; re-admitting traffic",
                               time.monotonic() - started)
                break
