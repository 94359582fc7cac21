"""The scheduler with speculative decoding, driven by a fake target and a fake drafter.

The target is a script: output token i of request r is `script[r][i]`, whatever the batch.
The drafter proposes the script's next tokens with deliberate mistakes; the fake runner
verifies like greedy decoding (accept the longest prefix equal to the target's tokens, then
emit the target's own token). Every step replays a slot-level model of the KV cache: each
token written lands in its slot, drafts included, and every scheduled request must read
exactly its own accepted tokens (plus this step's) in its context, so KV of a rejected draft
is never served, neither to its own request nor through the prefix cache.
"""
from __future__ import annotations

import random

import pytest

from deepinfer.core.compute_budget import ComputeAwareBudget
from deepinfer.core.cost_model import CostModel
from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.model_shape import ModelShape
from deepinfer.core.request import Request, RequestStatus
from deepinfer.core.scheduler import Scheduler, SchedulerConfig
from deepinfer.core.scheduler_output import SchedulerOutput, StepResult
from deepinfer.core.step_budget import TokenBudgetPolicy
from deepinfer.sampling_params import SamplingParams

EOS = 2


class SpecHarness:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, budget: int = 64,
                 max_num_seqs: int = 8, lookahead: int = 0, caching: bool = True,
                 max_model_len: int = 1024) -> None:
        self.bs, self.budget = block_size, budget
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, max_model_len,
                                               num_lookahead_tokens=lookahead),
                               self.kv, TokenBudgetPolicy(budget))
        self.scripts: dict[str, list[int]] = {}
        self.all: dict[str, Request] = {}
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token written there
        self.num_drafted = 0

    def add(self, request_id: str, prompt: list[int], script: list[int], **kw) -> Request:
        kw.setdefault("temperature", 0.0)
        kw.setdefault("max_tokens", len(script))
        request = Request(request_id, list(prompt), SamplingParams(**kw), eos_token_ids=(EOS,))
        self.sched.add_request(request)
        self.scripts[request_id] = script
        self.all[request_id] = request
        return request

    def step(self, draft, rng: random.Random | None = None) -> SchedulerOutput:
        out = self.sched.schedule(0.0)
        self.check_and_replay(out)
        result = StepResult({})
        for s in out.scheduled:
            if not s.sample:
                continue
            script = self.scripts[s.request_id]
            target = [script[min(s.num_output_tokens + j, len(script) - 1)]
                      for j in range(1 + s.num_draft_tokens)]
            if s.num_draft_tokens == 0:
                result.sampled_token_ids[s.request_id] = target[0]
                continue
            accepted = 0
            for d, t in zip(s.draft_token_ids, target):
                if d != t:
                    break
                accepted += 1
            result.verified_token_ids[s.request_id] = target[:accepted + 1]
        update = self.sched.update(out, result)
        for request_id, tokens in update.new_token_ids.items():
            request = self.all[request_id]
            n = request.num_output_tokens
            assert request.output_token_ids == self.scripts[request_id][:n]
        for s in out.scheduled:  # the drafter runs after the step, for running requests
            request = self.sched.requests.get(s.request_id)
            if request is None or request.status != RequestStatus.RUNNING \
                    or request.num_tokens - request.num_computed_tokens != 1:
                continue
            proposal = draft(request, self.scripts[s.request_id], rng)
            self.num_drafted += len(proposal)
            self.sched.set_draft_tokens(s.request_id, proposal)
        self.sched.check_invariants()
        return out

    def check_and_replay(self, out: SchedulerOutput) -> None:
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= self.budget
        for s in out.scheduled:
            request = self.sched.requests[s.request_id]
            known = request.all_token_ids[s.num_computed_tokens:]
            assert s.token_ids[:len(s.token_ids) - s.num_draft_tokens] == known[:len(s.token_ids)
                                                                                 - s.num_draft_tokens]
            assert s.num_draft_tokens == 0 or (s.sample and len(known) == 1)
            assert len(s.block_ids) * self.bs >= s.context_len
            for p, token in zip(range(s.num_computed_tokens, s.context_len), s.token_ids):
                self.slots[(s.block_ids[p // self.bs], p % self.bs)] = token
        for s in out.scheduled:  # all writes land before any read
            own = self.sched.requests[s.request_id].all_token_ids[:s.num_computed_tokens] + s.token_ids
            seen = [self.slots.get((s.block_ids[p // self.bs], p % self.bs)) for p in range(s.context_len)]
            assert seen == own, f"{s.request_id} reads KV it did not compute (a rejected draft?)"

    def run(self, draft, rng=None, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            self.step(draft, rng)
            if not self.sched.has_unfinished_requests():
                self.step(draft, rng)
                return
        raise AssertionError("not finished")


def noisy_drafter(k: int, error_rate: float):
    """Proposes the script's next k tokens, each wrong with probability error_rate."""
    def draft(request: Request, script: list[int], rng: random.Random) -> list[int]:
        n = request.num_output_tokens
        out = []
        for t in script[n:n + k]:
            out.append(t if rng.random() >= error_rate else t + 1)
        return out
    return draft


def make_script(rng: random.Random, n: int, with_eos: bool = False) -> list[int]:
    base = [rng.randrange(10, 40) for _ in range(6)]
    script = [base[i % 6] if rng.random() < 0.7 else rng.randrange(10, 40) for i in range(n)]
    if with_eos:
        script[rng.randrange(n // 2, n)] = EOS
    return script


@pytest.mark.parametrize("seed", range(12))
def test_outputs_equal_the_target_across_preemption_prefix_hits_and_budgets(seed):
    rng = random.Random(seed)
    k = 1 + seed % 6
    h = SpecHarness(num_blocks=rng.choice([12, 20, 64]), budget=rng.choice([6, 16, 64]),
                    lookahead=k if seed % 2 else 0)
    shared = [rng.randrange(100, 200) for _ in range(9)]
    for i in range(5):
        prompt = shared + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 7))]
        h.add(f"r{i}", prompt, make_script(rng, 30, with_eos=i % 2 == 0),
              max_tokens=rng.randrange(4, 30))
    h.run(noisy_drafter(k, error_rate=rng.choice([0.0, 0.2, 0.6])), rng)
    for request_id, request in h.all.items():
        script = h.scripts[request_id]
        expected = script[:request.sampling_params.max_tokens]
        if EOS in expected:
            expected = expected[:expected.index(EOS) + 1]
        assert request.output_token_ids == expected
        assert request.is_finished
    assert h.kv.pool.num_used_blocks == 0
    stats = h.sched.spec_stats
    assert stats.num_draft_tokens <= h.num_drafted
    assert stats.num_accepted_tokens <= stats.num_draft_tokens


def test_several_accepted_tokens_stop_exactly_at_eos_and_max_tokens():
    h = SpecHarness()
    script = [11, 12, 13, EOS, 15, 16]
    h.add("eos", [5, 6, 7], script, max_tokens=6)
    h.add("len", [5, 6, 8], [21, 22, 23, 24, 25, 26, 27], max_tokens=3)
    h.step(noisy_drafter(6, 0.0), random.Random(0))  # prefill: first token of each
    out = h.step(noisy_drafter(6, 0.0), random.Random(0))  # verify the drafts
    by_id = {s.request_id: s for s in out.scheduled}
    assert by_id["eos"].num_draft_tokens == 4  # max_tokens 6: one out, at most 5 more
    assert by_id["len"].num_draft_tokens == 1  # max_tokens 3: one out, at most 2 more
    assert h.all["eos"].output_token_ids == [11, 12, 13, EOS]
    assert h.all["eos"].status == RequestStatus.FINISHED_STOPPED
    assert h.all["len"].output_token_ids == [21, 22, 23]
    assert h.all["len"].status == RequestStatus.FINISHED_LENGTH


def test_verification_tokens_count_against_the_token_budget():
    h = SpecHarness(budget=10)
    for i in range(4):
        h.add(f"r{i}", [7, 8, 9 + i], [30 + j for j in range(12)])
    rng = random.Random(0)
    h.step(noisy_drafter(4, 0.0), rng)
    out = h.step(noisy_drafter(4, 0.0), rng)
    assert out.num_batched_tokens == 10  # 1 + 4, 1 + 4: the budget, not 4 x 5
    assert [s.num_new_tokens for s in out.scheduled] == [5, 5]


def test_rejected_drafts_blocks_are_freed_and_never_hashed():
    h = SpecHarness(block_size=4, lookahead=0)
    h.add("a", [1, 3, 5], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], max_tokens=10)
    always_wrong = lambda request, script, rng: [99] * 8  # noqa: E731
    no_drafts = lambda request, script, rng: []  # noqa: E731
    h.step(always_wrong)  # prefill 3 + sample 1 -> 4 tokens, 3 computed
    out = h.step(no_drafts)  # verify 1 + 8 drafts (max_tokens allows 9 more): 3 blocks
    (s,) = out.scheduled
    assert s.num_draft_tokens == 8 and len(s.block_ids) == 3
    request = h.all["a"]
    assert request.num_computed_tokens == 4 and request.output_token_ids == [40, 41]
    # Only the block full of known tokens is registered in the prefix cache.
    assert sum(b.block_hash is not None for b in h.kv.pool.blocks) == 1
    out = h.step(no_drafts)  # the next allocation frees the blocks past the accepted KV
    (s,) = out.scheduled
    assert s.context_len == 5 and len(s.block_ids) == 2
    assert h.kv.pool.num_used_blocks == 2


def test_lookahead_slots_are_allocated_but_not_cached():
    h = SpecHarness(block_size=4, lookahead=5)
    h.add("a", [1, 2, 3, 4, 5, 6, 7], [40, 41, 42], max_tokens=3)
    (s,) = h.step(lambda request, script, rng: []).scheduled
    assert s.context_len == 7 and len(s.block_ids) == 3  # 7 + 5 lookahead slots
    assert sum(b.block_hash is not None for b in h.kv.pool.blocks) == 1


def test_lookahead_never_preempts():
    h = SpecHarness(num_blocks=2, block_size=4, lookahead=6)
    h.add("a", [1, 2, 3, 4, 5, 6], [40, 41], max_tokens=2)
    (s,) = h.step(lambda request, script, rng: []).scheduled
    assert len(s.block_ids) == 2 and h.sched.num_preemptions == 0


def test_set_draft_tokens_caps_at_max_model_len_and_ignores_non_decodes():
    h = SpecHarness(max_model_len=12)
    h.add("a", list(range(10, 19)), [40, 41, 42, 43, 44], max_tokens=5)
    h.step(lambda request, script, rng: [])
    request = h.all["a"]  # 10 tokens, 9 computed: positions 10, 11 remain
    assert h.sched.max_num_drafts(request) == 2
    h.sched.set_draft_tokens("a", [1, 2, 3, 4])
    assert request.spec_token_ids == [1, 2]
    h.add("b", list(range(10, 15)), [40])
    h.sched.set_draft_tokens("b", [1, 2])  # waiting: ignored
    assert h.all["b"].spec_token_ids == []


def test_preemption_drops_pending_drafts():
    h = SpecHarness(num_blocks=8, block_size=4, budget=64)
    h.add("a", list(range(10, 17)), list(range(40, 60)), max_tokens=20)
    h.add("b", list(range(20, 27)), list(range(60, 80)), max_tokens=20)
    rng = random.Random(1)
    while not h.sched.num_preemptions:
        h.step(noisy_drafter(3, 0.0), rng)
    for request in h.sched.waiting:
        assert request.spec_token_ids == []
    h.run(noisy_drafter(3, 0.0), rng)
    assert h.all["a"].output_token_ids == list(range(40, 60))
    assert h.all["b"].output_token_ids == list(range(60, 80))


def test_verified_tokens_that_do_not_start_with_the_drafts_are_an_error():
    h = SpecHarness()
    h.add("a", [1, 2, 3], [40, 41, 42, 43], max_tokens=4)
    h.step(lambda request, script, rng: [41, 42])
    out = h.sched.schedule(0.0)
    with pytest.raises(ValueError, match="do not start with its drafts"):
        h.sched.update(out, StepResult({}, verified_token_ids={"a": [7, 42]}))


def _compute_budget(step_time_s: float) -> ComputeAwareBudget:
    shape = ModelShape(num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, hidden_size=64,
                       active_params=1_000_000, kv_bytes_per_token=512, weight_bytes=4_000_000)
    model = CostModel(shape, {"linear_flops": 1e-9, "attention_flops": 1e-9, "step": 1e-4})
    return ComputeAwareBudget(model.new_estimate(), step_time_s, block_size=16,
                              min_chunk_tokens=8, max_num_batched_tokens=None)


def test_compute_aware_verification_keeps_its_token_and_is_not_a_prefill_chunk():
    budget = _compute_budget(step_time_s=1e-4)  # nothing but the step overhead fits
    assert budget.fit_chunk(100, 5, decode=True) == 1  # the decode's own token, no drafts
    budget.consume(100, 1, decode=True)
    roomy = _compute_budget(step_time_s=1.0)
    assert roomy.fit_chunk(100, 5, decode=True) == 5  # not cut to a block boundary
    roomy.consume(100, 5, decode=True)
    assert roomy.num_prefill_chunks == 0  # the first prefill chunk keeps its minimum
    assert roomy.fit_chunk(100, 5) == 5
