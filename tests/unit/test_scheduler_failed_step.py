"""`Scheduler.reset_failed_step`: after a step whose execution raised, nothing it scheduled may
be read as computed. Blocks are registered in the prefix cache when scheduled, so a failed
step leaves registered blocks holding partial KV; another request may even have hit them in
the same step. The harness's KV model (tests/unit/test_scheduler.py) marks the failed step's
new blocks as garbage and checks, every later step, that each request attends only to blocks
holding its own prefix.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.core.request import RequestStatus
from tests.unit.test_scheduler import Harness, params, prompt

GARBAGE = (-1,)


def fail_step(h: Harness):
    """Schedule a step, then fail it before anything is applied (its new KV is garbage)."""
    h.now += 0.01
    out = h.sched.schedule(h.now)
    h.check_output(out)
    for s in out.scheduled:
        for i in range(s.num_computed_tokens // h.bs, len(s.block_ids)):
            h.content[s.block_ids[i]] = GARBAGE
    h.sched.reset_failed_step(out)
    h.sched.check_invariants()
    return out


def test_a_same_step_prefix_hit_on_a_failed_owner_is_recomputed():
    h = Harness(block_size=4)
    shared = prompt(12, seed=5)
    h.add("owner", shared + [1, 2])
    h.add("hitter", shared + [3, 4, 5])  # hits the owner's blocks scheduled in the same step
    out = fail_step(h)
    assert [s.request_id for s in out.scheduled] == ["owner", "hitter"]
    assert next(s for s in out.scheduled if s.request_id == "hitter").num_computed_tokens == 12
    assert all(h.all[r].status == RequestStatus.PREEMPTED for r in ("owner", "hitter"))
    assert not any(h.kv.pool.is_cached(x) for x in h.all["owner"].block_hashes)
    h.sched.finish_requests(["owner"], RequestStatus.FINISHED_ABORTED)  # the culprit
    out = h.step()
    hitter = next(s for s in out.scheduled if s.request_id == "hitter")
    assert hitter.num_computed_tokens == 0  # no hit on the garbage blocks
    h.run()
    h.assert_no_leaks()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 3), st.integers(1, 6)),
                min_size=1, max_size=6),
       st.sets(st.integers(0, 40), max_size=6), st.integers(0, 1000))
def test_failed_steps_never_leave_partial_kv_readable(requests, failing_steps, seed):
    h = Harness(num_blocks=24, block_size=4, max_num_batched_tokens=16)
    head = prompt(8, seed=seed)  # a common head: prefix hits across requests
    for i, (length, num_shared_blocks, max_tokens) in enumerate(requests):
        h.add(f"r{i}", head[:4 * num_shared_blocks // 2] + prompt(length, seed=seed + i),
              params(max_tokens=max_tokens))
    for step in range(400):
        if not h.sched.has_unfinished_requests():
            break
        if step in failing_steps:
            fail_step(h)
        else:
            h.step()  # replay_kv asserts every read block holds the reader's own prefix
    assert not h.sched.has_unfinished_requests()
    h.step()
    h.assert_no_leaks()
