"""The continuous-batching Scheduler driven by fake step results.

`Harness.step()` checks every SchedulerOutput against the request state (budget, max_num_seqs,
tokens, positions, block tables, when to sample), and replays the step on a model of what each
KV block holds: every request may only attend to blocks holding exactly its own token prefix,
whether it computed them, shared them through the prefix cache, or got them after preemption.
`check_invariants()` runs after every step.
"""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.request import Request, RequestStatus
from deepinfer.core.scheduler import Scheduler, SchedulerConfig
from deepinfer.core.scheduler_output import ScheduledRequest, SchedulerOutput, StepResult
from deepinfer.core.step_budget import TokenBudgetPolicy
from deepinfer.sampling_params import SamplingParams

EOS = 2
Sampler = Callable[[ScheduledRequest], int]


def params(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(**kw)


def constant(token: int = 7) -> Sampler:
    return lambda s: token


def scripted(scripts: dict[str, list[int]], default: int = 7) -> Sampler:
    """Output token i of request r is scripts[r][i]: independent of batching and preemption."""
    return lambda s: (scripts.get(s.request_id, [])[s.num_output_tokens:] or [default])[0]


class Harness:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                 max_num_seqs: int = 8, max_model_len: int = 1024, chunked: bool = True,
                 caching: bool = True) -> None:
        self.bs = block_size
        self.budget = max_num_batched_tokens
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, max_model_len, chunked), self.kv,
                               TokenBudgetPolicy(max_num_batched_tokens))
        self.all: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}
        self.outputs: list[SchedulerOutput] = []
        self.first_scheduled: list[str] = []  # admission order (first time scheduled)
        self.content: dict[int, tuple[int, ...]] = {}  # block id -> token prefix written to it
        self.now = 0.0

    def add(self, request_id: str, prompt: list[int], sampling: SamplingParams | None = None,
            eos: tuple[int, ...] = (EOS,)) -> Request:
        request = Request(request_id, list(prompt), sampling or params(), arrival_time=self.now,
                          eos_token_ids=eos)
        self.sched.add_request(request)
        self.all[request_id] = request
        return request

    def step(self, sampler: Sampler = constant()) -> SchedulerOutput:
        self.now += 0.01
        out = self.sched.schedule(self.now)
        self.check_output(out)
        self.replay_kv(out)
        result = StepResult({s.request_id: sampler(s) for s in out.scheduled if s.sample})
        update = self.sched.update(out, result)
        for request in update.finished:
            assert request.is_finished and request.request_id not in self.sched.requests
            self.finished[request.request_id] = request
        for request_id, tokens in update.new_token_ids.items():
            assert tokens == [result.sampled_token_ids[request_id]]
        self.sched.check_invariants()
        self.outputs.append(out)
        return out

    def run(self, sampler: Sampler = constant(), max_steps: int = 5000) -> int:
        for num_steps in range(1, max_steps + 1):
            self.step(sampler)
            if not self.sched.has_unfinished_requests():
                self.step(sampler)  # flush finished ids / outside-update finishes
                return num_steps
        raise AssertionError(f"not finished after {max_steps} steps")

    # ---- per-step checks ---------------------------------------------------------------------
    def check_output(self, out: SchedulerOutput) -> None:
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        assert len(ids) <= self.sched.config.max_num_seqs
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= self.budget
        assert not set(out.preempted_request_ids) & set(ids)
        for request_id in out.preempted_request_ids:
            request = self.all[request_id]
            assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0
        for s in out.scheduled:
            request = self.sched.requests[s.request_id]
            assert request.status == RequestStatus.RUNNING
            start = s.num_computed_tokens
            assert start == request.num_computed_tokens and s.num_new_tokens >= 1
            assert s.token_ids == request.all_token_ids[start:s.context_len]
            assert s.sample == (s.context_len == request.num_tokens)
            assert s.num_output_tokens == request.num_output_tokens
            assert s.block_ids == self.kv.block_ids(s.request_id)
            assert len(s.block_ids) == -(-s.context_len // self.bs)
            if s.request_id not in self.first_scheduled:
                self.first_scheduled.append(s.request_id)

    def replay_kv(self, out: SchedulerOutput) -> None:
        """All writes of a step land before any read (the runner's contract), then every
        scheduled request's context blocks must hold exactly its own prefix."""
        written: dict[int, tuple[int, ...]] = {}
        for s in out.scheduled:
            tokens = tuple(self.sched.requests[s.request_id].all_token_ids[:s.context_len])
            start = s.num_computed_tokens
            if start % self.bs:  # the block is partly written by earlier steps of this request
                held = self.content.get(s.block_ids[start // self.bs], ())
                assert held[:start] == tokens[:start], f"{s.request_id} lost its partial block"
            for i in range(s.num_computed_tokens // self.bs, len(s.block_ids)):
                prefix = tokens[:min((i + 1) * self.bs, s.context_len)]
                block_id = s.block_ids[i]
                assert written.get(block_id, prefix) == prefix, "two writers in one block"
                written[block_id] = prefix
        self.content.update(written)
        for s in out.scheduled:
            tokens = self.sched.requests[s.request_id].all_token_ids
            for i, block_id in enumerate(s.block_ids):
                end = min((i + 1) * self.bs, s.context_len)
                assert self.content.get(block_id, ())[:end] == tuple(tokens[:end]), \
                    f"{s.request_id} attends to block {block_id} holding other tokens"

    def assert_no_leaks(self) -> None:
        assert not self.sched.has_unfinished_requests() and not self.sched.requests
        assert self.kv.pool.num_used_blocks == 0 and not self.kv.req_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


# ---- batching and budgets ----------------------------------------------------------------------
def test_one_step_mixes_decodes_and_a_prefill_chunk():
    h = Harness(max_num_batched_tokens=16)
    h.add("a", prompt(5), params(max_tokens=20))
    h.step()
    assert h.all["a"].num_output_tokens == 1
    h.add("b", prompt(40, seed=1), params(max_tokens=3))
    out = h.step()
    by_id = {s.request_id: s for s in out.scheduled}
    assert by_id["a"].num_new_tokens == 1 and by_id["a"].sample
    assert by_id["b"].num_new_tokens == 15 and not by_id["b"].sample  # the rest of the budget
    assert out.num_batched_tokens == 16


def test_chunked_prefill_splits_a_long_prompt_and_samples_on_the_last_chunk():
    h = Harness(max_num_batched_tokens=8)
    h.add("long", prompt(30), params(max_tokens=2))
    chunks = []
    while h.all["long"].num_output_tokens == 0:
        out = h.step()
        (s,) = out.scheduled
        chunks.append((s.num_computed_tokens, s.num_new_tokens, s.sample))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]
    (s,) = h.step().scheduled
    assert (s.num_computed_tokens, s.num_new_tokens, s.sample) == (30, 1, True)
    assert h.finished["long"].output_token_ids == [7, 7]


class CappedChunkPolicy:
    """A token budget that also caps each request's chunk (like a compute-aware budget that
    shrinks chunks as context grows)."""

    name = "capped"

    def __init__(self, total: int, per_request: int) -> None:
        self.total, self.per_request = total, per_request

    def new_step(self):
        policy = self

        class Budget:
            remaining = policy.total
            predicted_time_s = None

            def fit_chunk(self, context_len: int, num_tokens: int) -> int:
                return max(0, min(num_tokens, self.remaining, policy.per_request))

            def consume(self, context_len: int, num_tokens: int) -> None:
                self.remaining -= num_tokens

        return Budget()


def test_running_decodes_are_served_before_running_prefill_chunks():
    h = Harness(max_num_batched_tokens=4)
    h.sched.budget_policy = CappedChunkPolicy(total=4, per_request=3)
    h.add("prefill", prompt(30), params(max_tokens=2))
    h.add("decode", prompt(1, seed=1), params(max_tokens=20, ignore_eos=True))
    out = h.step()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("prefill", 3),
                                                                        ("decode", 1)]
    out = h.step()  # the older request is still prefilling; the decode still gets its token
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("decode", 1),
                                                                        ("prefill", 3)]
    h.run()
    h.assert_no_leaks()


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits_in_whole():
    h = Harness(max_num_batched_tokens=10, chunked=False)
    h.add("a", prompt(6), params(max_tokens=5))
    h.add("b", prompt(8, seed=1), params(max_tokens=5))
    out = h.step()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 6)]
    out = h.step()  # 1 decode + 8 prompt tokens = 9 <= 10
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 8)]
    h.run()
    h.assert_no_leaks()


def test_without_chunked_prefill_a_prompt_over_the_token_budget_is_rejected_up_front():
    h = Harness(max_num_batched_tokens=10, chunked=False)
    with pytest.raises(ValueError, match="more than max_num_batched_tokens"):
        h.add("big", prompt(12), params(max_tokens=2))
    assert "big" not in h.sched.requests and h.sched.num_waiting == 0
    h.add("small", prompt(3, seed=1), params(max_tokens=2))
    h.run(max_steps=50)
    assert sorted(h.finished) == ["small"]
    h.assert_no_leaks()


def test_without_chunked_prefill_an_oversized_prompt_does_not_stall_the_queue():
    # A budget with no token limit to check up front (like compute-aware): a prompt larger
    # than any step's budget must still run (alone in its step), and the queue behind it too.
    h = Harness(max_num_batched_tokens=64, chunked=False)
    h.sched.budget_policy = CappedChunkPolicy(total=10, per_request=10)
    h.add("big", prompt(30), params(max_tokens=2))
    h.add("small", prompt(3, seed=1), params(max_tokens=2))
    out = h.step()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("big", 30)]
    h.run(max_steps=50)
    assert sorted(h.finished) == ["big", "small"]
    h.assert_no_leaks()


def test_max_num_seqs_is_respected_and_admission_is_fcfs():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(6):
        h.add(f"r{i}", prompt(5 + i, seed=i), params(max_tokens=3 + (i % 2)))
    while h.sched.has_unfinished_requests():
        out = h.step()
        assert len(out.scheduled) <= 2 and h.sched.num_running <= 2
    h.step()
    assert h.first_scheduled == [f"r{i}" for i in range(6)]
    assert sorted(h.finished) == [f"r{i}" for i in range(6)]
    h.assert_no_leaks()


def test_head_of_line_request_that_does_not_fit_blocks_later_ones():
    # FCFS: a small request behind a large one that cannot get blocks is not admitted first.
    h = Harness(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    h.add("running", prompt(17), params(max_tokens=40, ignore_eos=True))  # 5 blocks
    h.step()
    h.add("large", prompt(20, seed=1), params(max_tokens=1))  # needs 5 blocks, 3 free
    h.add("small", prompt(2, seed=2), params(max_tokens=1))  # would fit in 1
    out = h.step()
    assert [s.request_id for s in out.scheduled] == ["running"]
    h.run()
    assert h.first_scheduled == ["running", "large", "small"]
    h.assert_no_leaks()


# ---- stop conditions ---------------------------------------------------------------------------
def test_max_tokens_finishes_with_length():
    h = Harness()
    h.add("a", prompt(5), params(max_tokens=4, ignore_eos=True))
    h.run(constant(EOS))
    request = h.finished["a"]
    assert request.output_token_ids == [EOS] * 4
    assert request.status.finish_reason == "length" and request.stop_token_id is None


def test_eos_stops_unless_ignore_eos():
    h = Harness()
    h.add("stops", prompt(5), params(max_tokens=10))
    h.add("ignores", prompt(5, seed=1), params(max_tokens=10, ignore_eos=True))
    h.run(scripted({"stops": [5, 6, EOS, 8], "ignores": [5, EOS, 6, EOS]}))
    stops, ignores = h.finished["stops"], h.finished["ignores"]
    assert stops.output_token_ids == [5, 6, EOS]
    assert stops.status.finish_reason == "stop" and stops.stop_token_id == EOS
    assert ignores.output_token_ids[:4] == [5, EOS, 6, EOS] and ignores.num_output_tokens == 10
    assert ignores.status.finish_reason == "length"


def test_min_tokens_delays_eos_and_stop_token_ids():
    h = Harness()
    h.add("eos", prompt(4), params(max_tokens=10, min_tokens=3))
    h.add("stop_id", prompt(4, seed=1), params(max_tokens=10, min_tokens=2, stop_token_ids=[9]))
    h.run(scripted({"eos": [EOS, EOS, 5, EOS, EOS], "stop_id": [9, 4, 9, 9]}))
    assert h.finished["eos"].output_token_ids == [EOS, EOS, 5, EOS]
    assert h.finished["stop_id"].output_token_ids == [9, 4, 9]
    assert h.finished["stop_id"].stop_token_id == 9
    assert all(r.status.finish_reason == "stop" for r in h.finished.values())


def test_stop_token_ids_stop_even_with_ignore_eos():
    h = Harness()
    h.add("a", prompt(4), params(max_tokens=10, ignore_eos=True, stop_token_ids=[11, 12]))
    h.run(scripted({"a": [EOS, 3, 12, 4]}))
    assert h.finished["a"].output_token_ids == [EOS, 3, 12]
    assert h.finished["a"].status.finish_reason == "stop"


def test_max_model_len_caps_generation():
    h = Harness(max_model_len=12)
    h.add("a", prompt(9), params(max_tokens=None, ignore_eos=True))
    h.run()
    assert h.finished["a"].num_tokens == 12 and h.finished["a"].status.finish_reason == "length"
    h.assert_no_leaks()


# ---- admission errors --------------------------------------------------------------------------
def test_prompts_longer_than_the_model_or_the_cache_are_rejected():
    h = Harness(num_blocks=4, block_size=4, max_model_len=100)  # cache: 16 tokens
    with pytest.raises(ValueError):
        h.add("cache", prompt(17))
    with pytest.raises(ValueError):
        h.add("cache_exact", prompt(16))
    h.add("fits", prompt(15), params(max_tokens=1))
    h2 = Harness(num_blocks=64, block_size=4, max_model_len=20)
    with pytest.raises(ValueError):
        h2.add("model", prompt(21))
    with pytest.raises(ValueError):
        h2.add("model_exact", prompt(20))
    h2.add("fits", prompt(19), params(max_tokens=5))
    with pytest.raises(ValueError):
        h2.add("fits", prompt(3))  # duplicate id
    h.run()
    h2.run()
    assert h2.finished["fits"].num_output_tokens == 1  # capped by max_model_len
    for harness in (h, h2):
        harness.assert_no_leaks()


def test_a_request_that_outgrows_the_whole_cache_finishes_with_length():
    h = Harness(num_blocks=4, block_size=4, max_model_len=1000)
    h.add("a", prompt(10), params(max_tokens=100, ignore_eos=True))
    h.run()
    request = h.finished["a"]
    assert request.status.finish_reason == "length"
    assert 16 <= request.num_tokens <= 17  # every computed token fitted in the 16 slots
    h.assert_no_leaks()


# ---- preemption --------------------------------------------------------------------------------
def test_preemption_with_a_tiny_cache_recomputes_and_every_request_finishes():
    h = Harness(num_blocks=10, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
    scripts = {f"r{i}": prompt(12, seed=100 + i) for i in range(4)}
    for i in range(4):
        h.add(f"r{i}", prompt(6, seed=i), params(max_tokens=12, ignore_eos=True))
    h.run(scripted(scripts))
    assert h.sched.num_preemptions > 0
    preempted = [r for r in h.finished.values() if r.num_preemptions]
    assert preempted
    for request_id, request in h.finished.items():
        assert request.output_token_ids == scripts[request_id]
        assert request.status.finish_reason == "length"
    # A preempted request is recomputed from its prompt and outputs, sampling only at the end.
    recomputes = [s for out in h.outputs for s in out.scheduled
                  if s.request_id == preempted[0].request_id and s.num_new_tokens > 1
                  and s.num_output_tokens > 0]
    assert recomputes
    h.assert_no_leaks()


def test_preemption_takes_the_most_recently_admitted_request_first():
    h = Harness(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    # Each needs up to 5 blocks (7 + 10 tokens); together they need 10 of the 6.
    h.add("old", prompt(7), params(max_tokens=10, ignore_eos=True))
    h.add("new", prompt(7, seed=1), params(max_tokens=10, ignore_eos=True))
    preempted_order = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        preempted_order += out.preempted_request_ids
    h.step()
    assert preempted_order and set(preempted_order) == {"new"}
    assert h.finished["old"].num_preemptions == 0 and h.finished["new"].num_preemptions > 0
    # num_cached_tokens is the hit at first admission, not at the recompute.
    assert h.finished["new"].num_cached_tokens == 0
    assert all(r.num_output_tokens == 10 for r in h.finished.values())
    h.assert_no_leaks()


def test_a_request_preempted_mid_prefill_resumes_from_its_full_cached_blocks():
    h = Harness(num_blocks=8, block_size=4, max_num_batched_tokens=10)
    h.add("old", prompt(5), params(max_tokens=4, ignore_eos=True))
    h.add("long", prompt(26, seed=1), params(max_tokens=2, ignore_eos=True))
    h.run()
    assert h.finished["long"].num_preemptions == 1
    chunks = [(s.num_computed_tokens, s.num_new_tokens) for out in h.outputs
              for s in out.scheduled if s.request_id == "long"]
    # Prefilled [0, 23) in chunks, preempted, then resumed after its 5 full blocks (20 tokens):
    # the half-written sixth block was never offered as a prefix hit.
    assert chunks[:3] == [(0, 5), (5, 9), (14, 9)]
    assert chunks[3] == (20, 6)
    assert h.finished["long"].num_output_tokens == 2
    h.assert_no_leaks()


def test_preempted_requests_are_readmitted_before_later_arrivals():
    h = Harness(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_num_seqs=2)
    h.add("old", prompt(7), params(max_tokens=10, ignore_eos=True))
    h.add("new", prompt(7, seed=1), params(max_tokens=10, ignore_eos=True))
    h.step()
    h.add("late", prompt(3, seed=2), params(max_tokens=2, ignore_eos=True))
    readmitted_at = None
    while h.sched.has_unfinished_requests():
        out = h.step()
        if "new" in out.preempted_request_ids:
            readmitted_at = None
            assert list(h.sched.waiting)[:2] == [h.all["new"], h.all["late"]]
        elif readmitted_at is None and any(s.request_id == "new" for s in out.scheduled):
            readmitted_at = len(h.outputs)
    assert h.finished["new"].num_preemptions > 0 and readmitted_at is not None
    assert h.first_scheduled.index("late") == 2
    first_late = next(i for i, out in enumerate(h.outputs, 1)
                      if any(s.request_id == "late" for s in out.scheduled))
    assert readmitted_at <= first_late
    h.assert_no_leaks()


def test_an_older_prefill_is_not_preempted_while_a_newer_decode_runs():
    h = Harness(num_blocks=8, block_size=4, max_num_batched_tokens=5)
    h.sched.budget_policy = CappedChunkPolicy(total=5, per_request=3)
    h.add("d0", prompt(1, seed=2), params(max_tokens=12, ignore_eos=True))
    h.add("prefill", prompt(24), params(max_tokens=2, ignore_eos=True))
    h.add("d1", prompt(1, seed=1), params(max_tokens=12, ignore_eos=True))
    out = h.step()
    assert [s.request_id for s in out.scheduled] == ["d0", "prefill", "d1"]
    while not out.preempted_request_ids:
        out = h.step()
    assert out.preempted_request_ids[0] == "d1"


def test_a_step_is_never_empty_while_requests_keep_running():
    h = Harness(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    h.sched.budget_policy = CappedChunkPolicy(total=4, per_request=3)
    h.add("prefill", prompt(30), params(max_tokens=2, ignore_eos=True))
    h.add("decode", prompt(1, seed=1), params(max_tokens=20, ignore_eos=True))
    while h.sched.has_unfinished_requests():
        out = h.step()
        assert not out.is_empty or h.sched.num_running == 0, \
            f"empty step with {h.sched.num_running} running (preempted {out.preempted_request_ids})"
    h.assert_no_leaks()


# ---- aborts ------------------------------------------------------------------------------------
def test_aborting_running_and_waiting_requests_frees_their_blocks():
    h = Harness(num_blocks=16, block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    h.add("run1", prompt(8), params(max_tokens=50, ignore_eos=True))
    h.add("run2", prompt(8, seed=1), params(max_tokens=50, ignore_eos=True))
    h.add("wait", prompt(8, seed=2), params(max_tokens=50, ignore_eos=True))
    h.step()
    h.step()
    assert h.sched.num_running == 2 and h.sched.num_waiting == 1
    used = h.kv.pool.num_used_blocks
    done = h.sched.finish_requests(["run1", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in done} == {"run1", "wait"}
    assert all(r.status.finish_reason == "abort" for r in done)
    assert h.kv.pool.num_used_blocks == used - 3  # run1 held 3 blocks, wait held none
    assert "run1" not in h.kv.req_blocks and "wait" not in h.kv.req_blocks
    h.sched.check_invariants()
    out = h.step()
    assert set(out.finished_request_ids) >= {"run1", "wait"}
    assert [s.request_id for s in out.scheduled] == ["run2"]
    h.sched.finish_requests(["run2"], RequestStatus.FINISHED_ABORTED)
    h.step()
    h.assert_no_leaks()


def test_abort_between_schedule_and_update_is_ignored_by_update():
    h = Harness()
    h.add("a", prompt(5), params(max_tokens=10))
    h.add("b", prompt(5, seed=1), params(max_tokens=10))
    out = h.sched.schedule(0.0)
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    update = h.sched.update(out, StepResult({"a": 7, "b": 7}))
    assert list(update.new_token_ids) == ["b"] and not update.finished
    assert h.all["a"].output_token_ids == []
    h.sched.check_invariants()
    assert "a" in h.sched.schedule(0.1).finished_request_ids


# ---- prefix cache ------------------------------------------------------------------------------
def test_a_repeated_prompt_hits_the_prefix_cache():
    h = Harness(block_size=4)
    p = prompt(14)
    h.add("first", p, params(max_tokens=2))
    h.run()
    h.add("second", p, params(max_tokens=2))
    out = h.step()
    (s,) = out.scheduled
    assert h.finished["first"].num_cached_tokens == 0
    assert s.num_computed_tokens == 12 and s.num_new_tokens == 2
    h.run()
    assert h.finished["second"].num_cached_tokens == 12
    assert h.kv.num_prefix_hits == 12 and h.kv.num_prefix_queries == 28
    h.assert_no_leaks()


def test_concurrent_equal_prompts_share_blocks():
    h = Harness(block_size=4)
    p = prompt(13)
    h.add("a", p, params(max_tokens=3))
    h.add("b", p, params(max_tokens=3))
    out = h.step()
    a, b = out.scheduled
    assert b.num_computed_tokens == 12 and b.block_ids[:3] == a.block_ids[:3]
    h.run()
    assert h.finished["b"].num_cached_tokens == 12
    h.assert_no_leaks()


def test_without_prefix_caching_nothing_is_cached():
    h = Harness(caching=False)
    p = prompt(14)
    h.add("first", p, params(max_tokens=2))
    h.run()
    h.add("second", p, params(max_tokens=2))
    h.run()
    assert h.finished["second"].num_cached_tokens == 0
    h.assert_no_leaks()


# ---- randomized workloads ----------------------------------------------------------------------
def expected_output(script: list[int], sp: SamplingParams, cap: int) -> tuple[int, set[str]]:
    """Number of output tokens and the acceptable finish reasons (ties may say either)."""
    first_stop = None
    for i, token in enumerate(script):
        if i + 1 >= sp.min_tokens and ((token == EOS and not sp.ignore_eos)
                                       or token in sp.stop_token_ids):
            first_stop = i + 1
            break
    if first_stop is None or first_stop > cap:
        return cap, {"length"}
    return first_stop, {"stop"} if first_stop < cap else {"stop", "length"}


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4]),
       num_blocks=st.integers(4, 24), budget=st.integers(1, 32), max_num_seqs=st.integers(1, 8),
       chunked=st.booleans(), caching=st.booleans())
def test_random_workloads_finish_correctly_without_leaks(seed, block_size, num_blocks, budget,
                                                         max_num_seqs, chunked, caching):
    rng = random.Random(seed)
    capacity = num_blocks * block_size
    max_model_len = rng.randint(max(2, capacity // 2), capacity)  # fits the cache alone
    if not chunked:
        budget = max(budget, max_model_len)  # prompts above the budget are rejected without chunking
    h = Harness(num_blocks, block_size, budget, max_num_seqs, max_model_len, chunked, caching)
    base = [rng.randrange(10, 14) for _ in range(capacity)]  # shared prefixes are common
    scripts, expected, aborted = {}, {}, set()
    pending = list(range(rng.randint(2, 12)))
    while pending or h.sched.has_unfinished_requests():
        while pending and rng.random() < 0.5:
            i = pending.pop(0)
            n = rng.randint(1, max_model_len - 1 if rng.random() < 0.2 else
                            max(1, max_model_len // 3))
            p = base[:n] if rng.random() < 0.6 else [rng.randrange(10, 14) for _ in range(n)]
            sp = params(max_tokens=rng.choice([None, rng.randint(1, 30)]),
                        min_tokens=0, ignore_eos=rng.random() < 0.3,
                        stop_token_ids=rng.sample([3, 4, 5], rng.randint(0, 2)))
            if sp.max_tokens is not None:
                sp.min_tokens = rng.randint(0, sp.max_tokens)
            script = [rng.choice([EOS, 3, 4, 5] + [6] * 40) for _ in range(max_model_len)]
            h.add(f"r{i}", p, sp)
            scripts[f"r{i}"] = script
            cap = min(sp.max_tokens or max_model_len, max_model_len - n)
            expected[f"r{i}"] = expected_output(script, sp, cap)
        if h.sched.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(h.sched.requests))
            h.sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        h.step(scripted(scripts))
        assert len(h.outputs) < 3000, "workload did not terminate"
    h.step()
    h.assert_no_leaks()
    for request_id, (num_tokens, reasons) in expected.items():
        if request_id in aborted:
            continue
        request = h.finished[request_id]
        assert request.output_token_ids == scripts[request_id][:num_tokens], request_id
        assert request.status.finish_reason in reasons


def test_blocks_held_by_a_transfer_do_not_make_a_waiting_request_fail():
    h = Harness(num_blocks=8, block_size=4)
    transfer = Request("t", prompt(20), params(max_tokens=5), eos_token_ids=(EOS,))
    transfer.append_output_token(7)  # sampled by the prefill worker
    assert len(h.sched.allocate_for_transfer(transfer)) == 5
    h.add("w", prompt(16, seed=3), params(max_tokens=2))  # 4 blocks; 3 free during the transfer
    h.step()
    assert "w" not in h.finished, f"finished early: {h.finished['w'].status.name}"
