"""The persistent input batch (runtime/input_batch.py) prepares exactly what the plain
per-step build (`ModelRunner._prepare`) prepares, every step of a real scheduler run: requests
joining and finishing, chunked prefills, preemption and recompute, prefix-cache hits,
speculative-decoding verification rows and lookahead blocks."""
from __future__ import annotations

import random
import types

import pytest
import torch

from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.request import Request
from deepinfer.core.scheduler import Scheduler, SchedulerConfig
from deepinfer.core.scheduler_output import SchedulerOutput, StepResult
from deepinfer.core.step_budget import TokenBudgetPolicy
from deepinfer.runtime.input_batch import PersistentInputBatch
from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache
from deepinfer.runtime.model_runner import ModelRunner
from deepinfer.sampling_params import SamplingParams

BS = 4
CPU = torch.device("cpu")


def _runner(decode_kernel: bool) -> ModelRunner:
    model = types.SimpleNamespace(config=types.SimpleNamespace(num_attention_heads=2))
    cache = PagedKVCache(KVCacheSpec(1, 1, 8, BS, torch.float32), 64, CPU)
    runner = ModelRunner(model, cache, CPU)
    # prepare never calls the kernel; it only decides which rows are decode rows and the mask
    runner.decode_kernel = object() if decode_kernel else None
    runner.input_batch = PersistentInputBatch(BS, CPU, rows=2, blocks=2)  # forces both growths
    runner.persistent_min_requests = 1  # every step through the persistent rows
    return runner


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.equal(a, b)


def assert_same_prepare(plain, persistent) -> None:
    ids, pos, meta, sample_idx, reqs = plain
    ids2, pos2, meta2, sample_idx2, reqs2 = persistent
    assert _same(ids, ids2) and _same(pos, pos2) and _same(sample_idx, sample_idx2)
    assert [r.request_id for r in reqs] == [r.request_id for r in reqs2]
    assert _same(meta.slot_mapping, meta2.slot_mapping)
    if meta.decode is None:
        assert meta2.decode is None
    else:
        d, d2 = meta.decode, meta2.decode
        assert d.num_tokens == d2.num_tokens
        assert _same(d.block_ids, d2.block_ids) and _same(d.context_lens, d2.context_lens)
        assert _same(d.attn_mask, d2.attn_mask)
    assert len(meta.prefills) == len(meta2.prefills)
    for c, c2 in zip(meta.prefills, meta2.prefills):
        assert (c.start, c.num_tokens, c.num_computed_tokens) == (c2.start, c2.num_tokens, c2.num_computed_tokens)
        assert _same(c.block_ids, c2.block_ids) and _same(c.attn_mask, c2.attn_mask)


def _drive(runner: ModelRunner, seed: int, lookahead: int) -> dict[str, int]:
    """A scheduler run with a small cache (preemptions), shared prompt prefixes (prefix hits),
    staggered arrivals and drafts; checks every step, returns what happened."""
    rng = random.Random(seed)
    kv = KVCacheManager(14, BS, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_model_len=64, num_lookahead_tokens=lookahead),
                      kv, TokenBudgetPolicy(12))
    shared = [rng.randrange(1, 50) for _ in range(9)]
    pending = []
    for i in range(14):
        prompt = (shared if i % 2 else []) + [rng.randrange(1, 50) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 12))
        pending.append(Request(f"r{i}", prompt, params, eos_token_ids=(0,)))
    seen = {"steps": 0, "preempted": 0, "verifications": 0, "short_chunks": 0, "prefix_hits": 0,
            "finished": 0}
    while pending or sched.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add_request(pending.pop(0))
        for request in list(sched.running):  # drafts for some running decodes
            if rng.random() < 0.4:
                sched.set_draft_tokens(request.request_id, [rng.randrange(1, 50) for _ in range(3)])
        out = sched.schedule(0.0)
        if out.is_empty:
            continue
        ordered = sorted(out.scheduled, key=lambda r: not runner._as_decode(r))
        assert_same_prepare(runner._prepare(ordered), runner.prepare_step(out, ordered))
        seen["steps"] += 1
        seen["preempted"] += len(out.preempted_request_ids)
        seen["finished"] += len(out.finished_request_ids)
        seen["verifications"] += sum(s.num_draft_tokens > 0 for s in out.scheduled)
        seen["short_chunks"] += sum(1 < s.num_new_tokens <= 16 and s.num_draft_tokens == 0
                                    for s in out.scheduled)
        seen["prefix_hits"] += sum(s.num_computed_tokens > 0 and s.num_new_tokens > 1
                                   and s.num_draft_tokens == 0 for s in out.scheduled)
        sampled, verified = {}, {}
        for s in out.scheduled:
            if not s.sample:
                continue
            if s.num_draft_tokens:  # accept a prefix of the drafts, then a token of our own
                k = rng.randint(0, s.num_draft_tokens)
                verified[s.request_id] = s.draft_token_ids[:k] + [rng.randrange(1, 50)]
            else:
                sampled[s.request_id] = rng.randrange(1, 50)
        sched.update(out, StepResult(sampled, verified_token_ids=verified))
    return seen


@pytest.mark.parametrize("decode_kernel", [False, True])
@pytest.mark.parametrize("seed,lookahead", [(0, 0), (1, 0), (2, 3), (3, 2)])
def test_persistent_batch_equals_plain_build_every_step(decode_kernel, seed, lookahead):
    seen = _drive(_runner(decode_kernel), seed, lookahead)
    # the run exercised what it is meant to
    assert seen["steps"] > 20 and seen["finished"] >= 10
    assert seen["verifications"] > 0 and seen["short_chunks"] > 0 and seen["prefix_hits"] > 0
    assert seen["preempted"] > 0


def test_reused_request_id_with_other_blocks_is_rewritten():
    """A caller that reuses an id with different blocks and reports nothing (a failed step's
    requests recomputed, a benchmark's synthetic steps) still gets its own blocks."""
    runner = _runner(True)
    params = SamplingParams(temperature=0.0)
    from deepinfer.core.scheduler_output import ScheduledRequest
    for blocks, computed in (([1, 2, 3], 9), ([7, 8, 9], 9), ([7, 8, 9, 4], 12), ([6, 8, 9, 4, 2], 16), ([5], 0)):
        s = ScheduledRequest("a", [3], computed, blocks, True, params, 1)
        out = SchedulerOutput([s], 1)
        assert_same_prepare(runner._prepare([s]), runner.prepare_step(out, [s]))


def test_finished_and_preempted_rows_are_freed():
    runner = _runner(True)
    params = SamplingParams(temperature=0.0)
    from deepinfer.core.scheduler_output import ScheduledRequest
    steps = [ScheduledRequest(f"x{i}", [3], 5, [i + 1, i + 2], True, params, 1) for i in range(5)]
    runner.prepare_step(SchedulerOutput(steps, 5), steps)
    assert runner.input_batch.num_rows == 5
    runner.prepare_step(SchedulerOutput(steps[:1], 1, preempted_request_ids=["x1"],
                                        finished_request_ids=["x2", "x3"]), steps[:1])
    assert runner.input_batch.num_rows == 2


def test_an_empty_step_still_frees_finished_rows():
    runner = _runner(True)
    params = SamplingParams(temperature=0.0)
    from deepinfer.core.scheduler_output import ScheduledRequest
    s = ScheduledRequest("y", [3], 5, [1, 2], True, params, 1)
    runner.prepare_step(SchedulerOutput([s], 1), [s])
    runner.execute(SchedulerOutput([], 0, finished_request_ids=["y"]))
    assert runner.input_batch.num_rows == 0


def test_small_steps_build_plain_lists_and_rows_stay_right():
    """Below persistent_min_requests the plain build runs; a row skipped meanwhile (its request
    got new blocks) is brought up to date when the persistent path sees it again."""
    runner = _runner(True)
    runner.persistent_min_requests = 3
    params = SamplingParams(temperature=0.0)
    from deepinfer.core.scheduler_output import ScheduledRequest
    others = [ScheduledRequest(f"o{i}", [3], 5, [20 + i, 30 + i], True, params, 1) for i in range(2)]
    a = ScheduledRequest("a", [3], 5, [1, 2], True, params, 1)
    runner.prepare_step(SchedulerOutput([a] + others, 3), [a] + others)
    assert runner.input_batch.num_rows == 3
    moved = ScheduledRequest("a", [3], 6, [9, 8], True, params, 1)  # alone: plain build
    runner.prepare_step(SchedulerOutput([moved], 1), [moved])
    moved = ScheduledRequest("a", [3], 7, [9, 8], True, params, 1)
    step = [moved] + others
    assert_same_prepare(runner._prepare(step), runner.prepare_step(SchedulerOutput(step, 3), step))
