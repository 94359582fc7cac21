"""`WorkerSupervisor`: when to restart a lost cluster worker, and when to give up. Pure
bookkeeping (no processes, no clock: `now` is passed in); `DisaggClient` spawns the processes.

    ALIVE ──lost──▶ BACKOFF ──due──▶ STARTING ──ready + first report──▶ ALIVE
                       ▲                 │ exited / failed / not ready in time
                       └─────────────────┘
    (more than `max_restarts` consecutive restarts ──▶ GAVE_UP, for good)

Back-off and give-up follow `core.restart_policy.RestartPolicy`, shared with the colocated
engine's supervisor.
"""
from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.core.restart_policy import RestartPolicy

__all__ = ["RestartPolicy", "WorkerState", "WorkerSupervisor", "RecoveryRecord",
           "LossDecision", "drive_restarts"]
MAX_RECOVERY_RECORDS = 1024


class WorkerState(enum.Enum):
    ALIVE = "alive"
    BACKOFF = "backoff"  # lost; waiting for its restart time
    STARTING = "starting"  # a new process is loading; not routable yet
    GAVE_UP = "gave_up"
    RETIRED = "retired"  # scaled down: draining or gone, never restarted


@dataclass
class RecoveryRecord:
    """One outage of one worker: lost at `lost_at`, routable again at `readmitted_at`
    (None while down or after giving up). `num_attempts`: processes started for it."""

    worker_id: str
    role: str
    reason: str
    lost_at: float
    num_attempts: int = 0
    readmitted_at: float | None = None
    gave_up: bool = False

    @property
    def recovery_s(self) -> float | None:
        return None if self.readmitted_at is None else self.readmitted_at - self.lost_at


@dataclass
class _Entry:
    role: str
    state: WorkerState = WorkerState.ALIVE
    num_consecutive: int = 0
    admitted_at: float = 0.0
    next_attempt_at: float = 0.0
    started_at: float = 0.0
    outage: RecoveryRecord | None = None


@dataclass(frozen=True)
class LossDecision:
    """What to do about a lost worker: restart at `restart_at`, or give up (None)."""

    worker_id: str
    restart_at: float | None
    num_consecutive: int

    @property
    def gave_up(self) -> bool:
        return self.restart_at is None


class WorkerSupervisor:
    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._entries: dict[str, _Entry] = {}
        self.num_restarts: Counter[str] = Counter()  # processes started per role
        self.num_gave_up: Counter[str] = Counter()
        self.records: deque[RecoveryRecord] = deque(maxlen=MAX_RECOVERY_RECORDS)

    def add_worker(self, worker_id: str, role: str, now: float) -> None:
        """A worker that is up and routable (initial start)."""
        self._entries[worker_id] = _Entry(role=role, admitted_at=now)

    def add_starting(self, worker_id: str, role: str, now: float) -> None:
        """A worker added while serving (scale-out): loading, admitted like a restart (its
        start is not counted as one); lost before admission, it is restarted per the policy."""
        self._entries[worker_id] = _Entry(role=role, state=WorkerState.STARTING, started_at=now)

    def retire(self, worker_id: str) -> None:
        """Scaled down: never restart it, whatever happens to it from now on."""
        self._entries[worker_id].state = WorkerState.RETIRED

    def remove(self, worker_id: str) -> None:
        """Forget a retired worker that is gone."""
        self._entries.pop(worker_id, None)

    def state(self, worker_id: str) -> WorkerState:
        return self._entries[worker_id].state

    def on_lost(self, worker_id: str, reason: str, now: float) -> LossDecision:
        """The worker (or the process started to replace it) is gone. Schedules the next
        restart after the back-off, or gives up after `max_restarts` consecutive ones."""
        e = self._entries[worker_id]
        if e.state in (WorkerState.GAVE_UP, WorkerState.RETIRED):
            return LossDecision(worker_id, None, e.num_consecutive)
        if e.state is WorkerState.BACKOFF:  # reported twice: one loss
            return LossDecision(worker_id, e.next_attempt_at, e.num_consecutive)
        if e.state is WorkerState.ALIVE:
            if now - e.admitted_at >= self.policy.stable_after_s:
                e.num_consecutive = 0
            e.outage = RecoveryRecord(worker_id, e.role, reason, lost_at=now)
            self.records.append(e.outage)
        e.num_consecutive += 1
        if e.num_consecutive > self.policy.max_restarts:
            e.state = WorkerState.GAVE_UP
            self.num_gave_up[e.role] += 1
            if e.outage is not None:
                e.outage.gave_up = True
            return LossDecision(worker_id, None, e.num_consecutive - 1)
        e.state = WorkerState.BACKOFF
        e.next_attempt_at = now + self.policy.backoff_s(e.num_consecutive)
        return LossDecision(worker_id, e.next_attempt_at, e.num_consecutive)

    def due(self, now: float) -> list[str]:
        """Workers whose restart time has come (sorted); call `on_started` for each."""
        return sorted(w for w, e in self._entries.items()
                      if e.state is WorkerState.BACKOFF and e.next_attempt_at <= now)

    def on_started(self, worker_id: str, now: float) -> None:
        e = self._entries[worker_id]
        if e.state is not WorkerState.BACKOFF:
            raise ValueError(f"{worker_id} is {e.state.value}, not waiting for a restart")
        e.state, e.started_at = WorkerState.STARTING, now
        self.num_restarts[e.role] += 1
        if e.outage is not None:
            e.outage.num_attempts += 1

    def starting(self) -> list[str]:
        """Workers whose replacement process is loading (sorted)."""
        return sorted(w for w, e in self._entries.items() if e.state is WorkerState.STARTING)

    def start_overdue(self, now: float) -> list[str]:
        """Starting workers not ready within `ready_timeout_s` (the caller kills them and
        reports `on_lost`)."""
        return sorted(w for w, e in self._entries.items() if e.state is WorkerState.STARTING
                      and now - e.started_at > self.policy.ready_timeout_s)

    def on_admitted(self, worker_id: str, now: float) -> RecoveryRecord | None:
        """The restarted worker is ready and reported: routable again. Returns the outage."""
        e = self._entries[worker_id]
        if e.state is not WorkerState.STARTING:
            raise ValueError(f"{worker_id} is {e.state.value}, not starting")
        e.state, e.admitted_at = WorkerState.ALIVE, now
        outage, e.outage = e.outage, None
        if outage is not None:
            outage.readmitted_at = now
        return outage


def drive_restarts(supervisor: WorkerSupervisor, now: float, process_of: Callable[[str], object],
                   lose: Callable[[str, str], None], restart: Callable[[str], None]) -> None:
    """One pass of the restart loop every front runs over its workers (P/D, encode): a
    replacement not ready in time is killed and lost again, one whose process exited is lost
    again, and every restart that is due is started. `process_of(worker_id)`: its process
    handle or None; `lose(worker_id, reason)` reports the loss to `supervisor.on_lost` (and
    whatever the front does with one); `restart(worker_id)` calls `on_started` and spawns."""
    for worker_id in supervisor.start_overdue(now):
        proc = process_of(worker_id)
        if proc is not None and proc.is_alive():
            proc.kill()
        lose(worker_id, f"restarted worker not ready after "
                        f"{supervisor.policy.ready_timeout_s:.0f} s")
    for worker_id in supervisor.starting():
        proc = process_of(worker_id)
        if proc is not None and not proc.is_alive():
            lose(worker_id, f"restarted process exited ({proc.exitcode})")
    for worker_id in supervisor.due(now):
        restart(worker_id)
