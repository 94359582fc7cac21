"""EngineSupervisor: the colocated engine restarted on the workers' state machine (back-off,
consecutive failures, give-up, reset after a stable run), driven with a fake client."""
from __future__ import annotations

import asyncio

from deepinfer.clients.engine_supervisor import EngineSupervisor
from deepinfer.cluster.worker_supervisor import WorkerState
from deepinfer.core.restart_policy import RestartPolicy


class FakeEngine:
    """Dies when told; each restart pops the next outcome (True: comes up, False: fails)."""

    def __init__(self, outcomes: list[bool]) -> None:
        self.outcomes = list(outcomes)
        self.dead = asyncio.Event()
        self.restarts: list[bool] = []

    async def wait_dead(self) -> None:
        await self.dead.wait()
        self.dead.clear()

    async def restart_engine(self) -> None:
        ok = self.outcomes.pop(0)
        self.restarts.append(ok)
        if not ok:
            raise RuntimeError("engine did not come up\nEngineDeadError: load failed")


async def _settle(sup: EngineSupervisor, engine: FakeEngine, restarts: int) -> None:
    for _ in range(500):
        if len(engine.restarts) >= restarts and (
                sup.gave_up or sup.state.state(sup.WORKER_ID) is WorkerState.ALIVE):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"supervisor stuck after {engine.restarts}")


def test_failed_restarts_back_off_then_the_engine_is_readmitted():
    async def main():
        engine = FakeEngine([False, False, True])
        sup = EngineSupervisor(engine, RestartPolicy(max_restarts=5, initial_backoff_s=0.01,
                                                     max_backoff_s=0.04))
        sup.start()
        engine.dead.set()
        await _settle(sup, engine, 3)
        assert engine.restarts == [False, False, True] and not sup.gave_up
        assert sup.state.num_restarts["engine"] == 3
        (record,) = sup.state.records
        assert record.num_attempts == 3 and record.recovery_s is not None
        await sup.stop()
    asyncio.run(main())


def test_gives_up_after_max_consecutive_restarts_and_stays_down():
    async def main():
        engine = FakeEngine([False] * 10)
        sup = EngineSupervisor(engine, RestartPolicy(max_restarts=2, initial_backoff_s=0.0,
                                                     max_backoff_s=0.0))
        sup.start()
        engine.dead.set()
        await _settle(sup, engine, 2)
        assert sup.gave_up and engine.restarts == [False, False]
        await asyncio.sleep(0.05)
        assert len(engine.restarts) == 2  # no further attempts once given up
        await sup.stop()
    asyncio.run(main())


def test_an_engine_that_stayed_up_starts_its_count_over():
    async def main():
        engine = FakeEngine([True, True, True])
        # stable after 0 s: every death after a successful restart is a first failure again,
        # so three deaths never reach max_restarts=1.
        sup = EngineSupervisor(engine, RestartPolicy(max_restarts=1, initial_backoff_s=0.0,
                                                     max_backoff_s=0.0, stable_after_s=0.0))
        sup.start()
        for n in (1, 2, 3):
            engine.dead.set()
            await _settle(sup, engine, n)
        assert engine.restarts == [True, True, True] and not sup.gave_up
        assert len(sup.state.records) == 3
        await sup.stop()
    asyncio.run(main())


def test_no_restarts_when_the_policy_allows_none():
    async def main():
        engine = FakeEngine([True])
        sup = EngineSupervisor(engine, RestartPolicy(max_restarts=0))
        sup.start()
        engine.dead.set()
        await asyncio.sleep(0.05)
        assert engine.restarts == [] and not sup.gave_up
        await sup.stop()
    asyncio.run(main())
