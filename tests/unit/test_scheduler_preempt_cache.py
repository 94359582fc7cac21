"""A request preempted after it was scheduled in the same step (a newer decode, scheduled
before an older prompt's chunk that then needs its blocks) must leave no block of that step in
the prefix cache: blocks are registered when scheduled, and the preempted step never computes
them. Before the fix its last block stayed cached with one slot never written, and a later
prompt extending its tokens (a chat's next turn) was served that garbage as a prefix hit: a
silently wrong answer, here on a decode with speculative lookahead slots (those blocks go
first in the free queue, so the registered block survives the preemption).

The KV model is the scheduler tests' harness (tests/unit/test_scheduler.py): every step, each
scheduled request must attend only to blocks holding its own prefix.
"""
from __future__ import annotations

from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.request import RequestStatus
from deepinfer.core.scheduler import Scheduler, SchedulerConfig
from deepinfer.core.scheduler_output import StepResult
from deepinfer.core.step_budget import TokenBudget
from tests.unit.test_scheduler import Harness, params, prompt


class ChunkCapBudget(TokenBudget):
    """At most 4 new tokens per request and step (as a compute-aware budget caps a long
    prompt's chunk while a short request still fits)."""

    def fit_chunk(self, context_len: int, num_tokens: int, *, decode: bool = False) -> int:
        return max(0, min(num_tokens, self.remaining, 4))


class ChunkCapPolicy:
    name = "chunk-cap"

    def new_step(self) -> ChunkCapBudget:
        return ChunkCapBudget(64)

    def observe_step(self, predicted_s: float, measured_s: float) -> None:
        pass


def step(h: Harness):
    out = h.sched.schedule(0.0)
    h.replay_kv(out)  # asserts every scheduled request reads only its own prefix
    h.sched.update(out, StepResult({s.request_id: 7 for s in out.scheduled if s.sample}))
    h.sched.check_invariants()
    return out


def test_a_victim_scheduled_in_the_same_step_leaves_no_uncomputed_block_cached():
    h = Harness(block_size=4)
    h.kv = KVCacheManager(5, 4, enable_prefix_caching=True)
    h.sched = Scheduler(SchedulerConfig(8, 1024, True, num_lookahead_tokens=12), h.kv,
                        ChunkCapPolicy())
    h.add("old", prompt(12, seed=1), params(max_tokens=3))  # chunked 4 tokens a step
    h.add("new", prompt(3, seed=2), params(max_tokens=3))  # prefilled at once, then decodes
    for _ in range(6):
        out = step(h)
        if "new" in out.preempted_request_ids:
            break
    else:
        raise AssertionError("the scenario never preempted the new request")
    new = h.all["new"]
    assert new.num_computed_tokens == 0 and new.num_tokens == 4  # its 4th token never ran
    assert not h.kv.pool.is_cached(new.block_hashes[0])
    # The chat's next turn: the first request's tokens and more.
    h.sched.finish_requests(["new"], RequestStatus.FINISHED_ABORTED)
    h.add("next-turn", new.all_token_ids + [11, 12], params(max_tokens=2))
    for _ in range(40):
        step(h)
        if not h.sched.has_unfinished_requests():
            break
    assert not h.sched.has_unfinished_requests()
    h.assert_no_leaks()
