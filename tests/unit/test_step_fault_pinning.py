"""`pin_step_fault`: which scheduled requests a failed step is blamed on (no model: `execute`
is a fake that fails for chosen request ids)."""
from __future__ import annotations

import pytest

from deepinfer.core.scheduler_output import ScheduledRequest, SchedulerOutput
from deepinfer.core.request_fault import RequestFault
from deepinfer.engine.step_faults import DebugStepFault, pin_step_fault
from deepinfer.sampling_params import SamplingParams


def batch(*request_ids: str, seeds: dict[str, int] | None = None) -> SchedulerOutput:
    seeds = seeds or {}
    scheduled = [ScheduledRequest(r, [1, 2], 0, [0], True, SamplingParams(seed=seeds.get(r)), 0)
                 for r in request_ids]
    return SchedulerOutput(scheduled, 2 * len(scheduled))


def failing_for(*bad: str):
    runs = []

    def execute(output: SchedulerOutput):
        runs.append([s.request_id for s in output.scheduled])
        if any(s.request_id in bad for s in output.scheduled):
            raise ValueError(f"bad input tensor for {bad}")
    return execute, runs


def test_each_request_alone_finds_the_culprits():
    execute, runs = failing_for("b", "d")
    culprits = pin_step_fault(execute, batch("a", "b", "c", "d"), RuntimeError("batch failed"))
    assert sorted(culprits) == ["b", "d"] and "ValueError: bad input tensor" in culprits["b"]
    assert runs == [["a"], ["b"], ["c"], ["d"]]


def test_a_fault_every_request_has_alone_or_none_has_is_the_engines():
    execute, _ = failing_for("a", "b")
    assert pin_step_fault(execute, batch("a", "b"), RuntimeError("x")) == {}
    execute, _ = failing_for()  # only the batch as a whole fails (e.g. out of memory)
    assert pin_step_fault(execute, batch("a", "b"), RuntimeError("x")) == {}


def test_a_request_fault_names_its_requests_without_reruns():
    execute, runs = failing_for()
    culprits = pin_step_fault(execute, batch("a", "b"), RequestFault(["b", "zz"], "bad params"))
    assert list(culprits) == ["b"] and runs == []


def test_a_lone_request_is_the_culprit():
    execute, runs = failing_for()
    assert list(pin_step_fault(execute, batch("a"), RuntimeError("x"))) == ["a"] and runs == []


def test_debug_hook_raises_only_for_its_seed(monkeypatch):
    monkeypatch.setenv("DEEPINFER_DEBUG_STEP_FAULT_SEED", "7")
    hook = DebugStepFault.from_env()
    hook.check(batch("a", "b", seeds={"a": 6}))
    with pytest.raises(RuntimeError, match="injected fault for request b"):
        hook.check(batch("a", "b", seeds={"b": 7}))
    monkeypatch.delenv("DEEPINFER_DEBUG_STEP_FAULT_SEED")
    DebugStepFault.from_env().check(batch("a", seeds={"a": 7}))  # off
