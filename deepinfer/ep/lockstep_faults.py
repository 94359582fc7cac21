"""Step-fault isolation on the ranks of an expert-parallel group: a step that raises on one
rank fails only the request(s) it is pinned on, as on a colocated engine
(engine/step_faults.py), without breaking the group's lockstep.

The catch is that a forward runs every MoE layer's collectives, so a rank whose forward raises
part-way must still join the ones it did not reach (its peers wait there), and every rank
must take the same decision before it commits the step. Per group step, on every rank:

  1. the forward (or the empty step). If it raises outside a collective, the rank runs the
     MoE layers it had not reached with no tokens (`finish_failed_forward`);
  2. one all-reduce over the control group: [ranks whose step failed, probes of each rank];
  3. nobody failed: the step commits as usual. Someone failed: every rank undoes its step
     (its requests are recomputed next step; a rank's outputs do not depend on what its peers
     run in the same step). A rank whose own step raised pins the fault by re-running its
     requests one at a time (`pin_step_fault`), each re-run a lockstep step of its own; the
     group runs as many such steps as the rank with the most, the others joining with empty
     steps. A failed step counts no EPLB load.

A fault inside a collective (the transport, or a peer that died) cannot be matched any more:
it is raised as `LockstepBroken` and the rank exits, so the front restarts the group as before.
"""
from __future__ import annotations

import logging

import torch

from deepinfer.engine.llm_engine import MAX_FAILED_STEPS_IN_ROW
from deepinfer.engine.step_faults import isolate_step_faults, num_probes

logger = logging.getLogger(__name__)


class LockstepBroken(RuntimeError):
    """The group's collectives can no longer be matched: the rank must exit (also when it
    happens while pinning a fault: `pin_step_fault` re-raises it)."""

    stops_engine = True


class PeerStepFault(RuntimeError):
    """Another rank's step failed: this rank's step is undone and recomputed."""


class LockstepStepFaults:
    """Installed on an EP rank's engine by its loop (which answers `take_request_failures()`)."""

    def __init__(self, engine, runtime, rank_group, role: str | None = None) -> None:
        self.engine = engine
        self.runtime = runtime
        self.rank_group = rank_group
        isolate_step_faults(engine, role)
        self._execute_alone = engine._execute
        self._recover_alone = engine._recover_failed_step
        engine._execute = self._execute
        engine._recover_failed_step = self._recover
        self._group_probes = 0  # probe steps the group agreed on for the failed step
        self._probes_run = 0
        self._probing = False
        self.num_peer_failed_steps = 0  # steps undone here because a peer's step failed

    # ---- the step --------------------------------------------------------------------------
    def _run(self, output):
        """This rank's forward; on an exception, the collectives it missed first."""
        self.runtime.begin_forward()
        try:
            return self._execute_alone(output)
        except Exception as exc:
            if not self.runtime.finish_failed_forward():
                raise LockstepBroken(f"step failed inside an MoE collective: {exc}") from exc
            raise

    def _execute(self, output):
        if self._probing:  # a re-run of one request while pinning this rank's fault
            self._probes_run += 1
            return self._run(output)
        error = result = None
        try:
            result = self._run(output)
        except LockstepBroken:
            raise
        except Exception as exc:
            error = exc
        probes = 0
        if error is not None and self.engine._num_failed_steps_in_row < MAX_FAILED_STEPS_IN_ROW:
            probes = num_probes(output, error)  # none when the engine is about to give up
        num_failed = self._agree(error is not None, probes)
        if error is not None:
            raise error
        if num_failed:
            raise PeerStepFault(f"{num_failed} peer rank(s) failed this step")
        return result

    def run_empty_step(self) -> None:
        """A rank with nothing to run this group step (instead of `runtime.run_empty_step`)."""
        try:
            self._empty_forward()
        except Exception as exc:  # no request to blame: only the transport runs here
            raise LockstepBroken(f"empty step failed: {exc}") from exc
        if self._agree(False, 0):
            self.num_peer_failed_steps += 1
            self.runtime.discard_step_loads()
            self._join_probes()

    def _agree(self, failed: bool, probes: int) -> int:
        """All-reduce [failed, probes of rank 0 .. N-1]; keeps the group's probe steps and
        returns how many ranks failed."""
        header = [int(failed)] + [0] * self.rank_group.world_size
        header[1 + self.rank_group.rank] = probes
        try:
            reduced = self.rank_group.all_reduce_cpu(header)
        except Exception as exc:
            raise LockstepBroken(f"step agreement failed: {exc}") from exc
        self._group_probes = max(reduced[1:])
        self._probes_run = 0
        return reduced[0]

    # ---- after a failed step ---------------------------------------------------------------
    def _recover(self, output, exc: Exception) -> None:
        if isinstance(exc, LockstepBroken):
            raise exc
        self.runtime.discard_step_loads()
        if isinstance(exc, PeerStepFault):
            self.num_peer_failed_steps += 1
            logger.warning("a peer rank's step failed; undoing this rank's step "
                           "(%d requests are recomputed)", len(output.scheduled))
            self.engine._undo_step(output)
        else:
            self._probing = True
            try:
                self._recover_alone(output, exc)  # pins (probes through _execute), undoes, fails
            finally:
                self._probing = False
        self._join_probes()

    def _join_probes(self) -> None:
        """Empty steps until the group has run the probe steps it agreed on."""
        if self._probes_run > self._group_probes:
            raise LockstepBroken(f"ran {self._probes_run} probe steps, the group agreed on "
                                 f"{self._group_probes}")
        while self._probes_run < self._group_probes:
            self._probes_run += 1
            self._empty_forward()
        self.runtime.discard_step_loads()

    def _empty_forward(self) -> None:
        """The MoE collectives of one step with no tokens (matching a peer's forward)."""
        self.runtime.begin_forward()
        with torch.inference_mode():
            self.runtime.run_empty_step()
