"""Scheduler hooks of disaggregated decode: allocate for a KV transfer, admit, cancel. Pure."""
from __future__ import annotations

from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.request import Request, RequestStatus
from deepinfer.core.scheduler import Scheduler, SchedulerConfig
from deepinfer.core.scheduler_output import StepResult
from deepinfer.core.step_budget import TokenBudgetPolicy
from deepinfer.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_model_len=64),
                     KVCacheManager(num_blocks, BS), TokenBudgetPolicy(64))


def prefilled(request_id: str, prompt_len: int, first_token: int = 7) -> Request:
    request = Request(request_id, list(range(1, prompt_len + 1)),
                      SamplingParams(temperature=0.0, max_tokens=4))
    request.append_output_token(first_token)
    return request


def test_transferred_request_decodes_from_the_first_token():
    sched = make_scheduler()
    request = prefilled("a", 9)
    block_ids = sched.allocate_for_transfer(request)
    assert len(block_ids) == 3  # ceil(9 / 4)
    assert sched.schedule(0.0).is_empty  # not schedulable while its KV is in flight
    sched.kv.update_block_hashes(request)
    assert not sched.kv.pool.is_cached(request.block_hashes[0])  # garbage until written
    sched.check_invariants()
    sched.admit_transferred("a")
    assert sched.kv.pool.is_cached(request.block_hashes[0])  # valid now: findable
    out = sched.schedule(0.0)
    [s] = out.scheduled
    assert (s.num_computed_tokens, s.token_ids, s.sample) == (9, [7], True)
    update = sched.update(out, StepResult({"a": 8}))
    assert update.new_token_ids == {"a": [8]} and request.output_token_ids == [7, 8]
    sched.check_invariants()


def test_no_room_changes_nothing_and_cancel_frees_blocks():
    sched = make_scheduler(num_blocks=4)
    assert sched.allocate_for_transfer(prefilled("big", 30)) is None
    assert sched.kv.pool.num_used_blocks == 0 and not sched.transferring
    assert sched.allocate_for_transfer(prefilled("a", 10)) is not None
    assert sched.kv.pool.num_used_blocks == 3
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # abort mid-transfer
    assert sched.kv.pool.num_used_blocks == 0 and not sched.transferring
    sched.check_invariants()


def test_transfers_respect_max_num_seqs():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64),
                      KVCacheManager(32, BS), TokenBudgetPolicy(64))
    assert sched.allocate_for_transfer(prefilled("a", 5)) is not None
    assert sched.allocate_for_transfer(prefilled("b", 5)) is not None
    used = sched.kv.pool.num_used_blocks
    assert sched.allocate_for_transfer(prefilled("c", 5)) is None  # room in KV, not in seqs
    assert sched.kv.pool.num_used_blocks == used and "c" not in sched.transferring
    sched.admit_transferred("a")
    sched.admit_transferred("b")
    sched.check_invariants()
    assert sched.allocate_for_transfer(prefilled("c", 5)) is None
    out = sched.schedule(0.0)
    sched.update(out, StepResult({"a": 2, "b": 2}))  # max_tokens=4: not finished yet
    sched.check_invariants()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.allocate_for_transfer(prefilled("c", 5)) is not None
    sched.admit_transferred("c")
    assert sched.num_running == 2
    sched.check_invariants()
