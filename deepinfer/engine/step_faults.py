"""When an engine step raises: which request caused it, and what the loop tells the front.

A step runs many requests in one batch, so an exception names no request by itself. Code that
knows the culprit raises `RequestFault`; otherwise `pin_step_fault` runs each scheduled
request alone (nothing of a failed step is applied, and a re-run writes the same KV slots):
the requests that fail alone are the culprits. If every one fails alone (or none does), the
fault is the engine's, not a request's.

`DebugStepFault` is the fault-injection hook the tests use over HTTP: with
DEEPINFER_DEBUG_STEP_FAULT_SEED=<int> in the engine's environment, a step that schedules a
request with that sampling seed raises, as a runner error caused by one request would. In a
disaggregated cluster an entry may name the worker role it applies to, e.g.
"prefill:7,decode:8" (a bare seed applies to every engine).

`isolate_step_faults` is what a loop that answers `take_request_failures()` calls on its
engine: the colocated engine loop and the disaggregated prefill / decode worker loops.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from deepinfer.core.request_fault import RequestFault
from deepinfer.core.scheduler_output import SchedulerOutput

DEBUG_FAULT_SEED_ENV = "DEEPINFER_DEBUG_STEP_FAULT_SEED"


@dataclasses.dataclass(frozen=True)
class RequestFailure:
    """A request the engine dropped with an error (the front answers it with `message`).
    `engine_fault`: the engine failed every request in flight, not only this one."""

    request_id: str
    message: str
    engine_fault: bool = False


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1][:300] if text else ''}".rstrip(": ")


def pin_step_fault(execute: Callable[[SchedulerOutput], object], output: SchedulerOutput,
                   exc: Exception) -> dict[str, str]:
    """The scheduled sequence ids to blame for `exc` (id -> error text); empty when the fault
    cannot be pinned on some but not all of them. Re-runs requests alone through `execute`."""
    ids = [s.request_id for s in output.scheduled]
    if isinstance(exc, RequestFault):
        return {i: describe(exc) for i in exc.request_ids if i in ids}
    if not num_probes(output, exc):
        return {ids[0]: describe(exc)} if ids else {}
    culprits = {}
    for sched in output.scheduled:
        alone = SchedulerOutput([sched], sched.num_new_tokens)
        try:
            execute(alone)
        except Exception as probe_exc:  # this request fails on its own
            if getattr(probe_exc, "stops_engine", False):  # e.g. an EP group out of step
                raise
            culprits[sched.request_id] = describe(probe_exc)
    if len(culprits) == len(ids):
        return {}  # every request fails: the engine is broken, not one request
    return culprits


def num_probes(output: SchedulerOutput, exc: Exception) -> int:
    """How many re-runs `pin_step_fault` makes for this fault (an expert-parallel group runs
    as many lockstep steps while one rank pins its fault: ep/lockstep_faults.py)."""
    if isinstance(exc, RequestFault) or len(output.scheduled) <= 1:
        return 0
    return len(output.scheduled)


def isolate_step_faults(engine, role: str | None = None) -> None:
    """A step that raises fails only the requests it is pinned on (the caller answers them
    from `engine.take_request_failures()` after every step); `role`'s debug faults apply."""
    engine.isolate_step_faults = True
    engine.debug_fault = DebugStepFault.from_env(role)


class DebugStepFault:
    """Raises inside the step for a request with a configured seed (tests only)."""

    def __init__(self, seed: int | None = None, *, seeds: tuple[int, ...] = ()) -> None:
        self.seeds = frozenset(seeds) | ({seed} if seed is not None else set())

    @classmethod
    def from_env(cls, role: str | None = None) -> DebugStepFault:
        """The seeds of DEEPINFER_DEBUG_STEP_FAULT_SEED that apply to an engine of `role`
        ("prefill", "decode"; None: a colocated engine, bare seeds only)."""
        seeds = []
        for entry in filter(None, os.environ.get(DEBUG_FAULT_SEED_ENV, "").split(",")):
            entry_role, _, seed = entry.strip().rpartition(":")
            if not entry_role or entry_role == role:
                seeds.append(int(seed))
        return cls(seeds=tuple(seeds))

    def check(self, output: SchedulerOutput) -> None:
        if not self.seeds:
            return
        for sched in output.scheduled:
            if sched.sampling_params.seed in self.seeds:
                raise RuntimeError(f"injected fault for request {sched.request_id} "
                                   f"({DEBUG_FAULT_SEED_ENV}, seed {sched.sampling_params.seed})")
