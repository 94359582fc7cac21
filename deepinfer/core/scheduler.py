"""Continuous-batching scheduler: one step mixes decodes and prefill chunks. Pure.

Each step: running requests first (FCFS; a decode needs one token, a partly prefilled prompt
its next chunk), then waiting requests while the budget, `max_num_seqs` and the KV cache allow.
When a running request cannot get a block, the most recently admitted running request is
preempted (its blocks freed; it is recomputed later, usually hitting the prefix cache).
`schedule(now)` returns a data-only SchedulerOutput; `update(output, result)` applies the step.

Speculative decoding: a running decode with draft tokens (`Request.spec_token_ids`, set by
`set_draft_tokens` between steps) is scheduled as one verification of 1 + k tokens, charged
to the budget like any tokens (its first token always served, as a decode). `update` appends
the accepted drafts and the target's own token, checking stops token by token, and steps
`num_computed_tokens` back over the rejected ones; their blocks are freed (`kv.trim`) before
the request's next allocation. Only known tokens are ever hashed into the prefix cache.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.request import Request, RequestStatus
from deepinfer.core.scheduler_output import ScheduledRequest, SchedulerOutput, StepResult
from deepinfer.core.spec_decode_stats import SpecDecodeStats
from deepinfer.core.step_budget import StepBudget, StepBudgetPolicy


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # KV slots allocated past a sampling chunk for a drafter model to write its own KV into
    # (speculative decoding with draft_model / mtp); best effort, never a reason to preempt.
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs must be >= 1 and max_model_len >= 2")
        if self.num_lookahead_tokens < 0:
            raise ValueError("num_lookahead_tokens must be >= 0")


@dataclass
class SchedulerUpdate:
    """What one step changed: new tokens per request and the requests that finished."""

    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 budget_policy: StepBudgetPolicy) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.budget_policy = budget_policy
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        self._finished_ids: list[str] = []  # to tell the runner on the next step
        self._finished_outside_update: list[Request] = []  # reported by the next update()
        # Disaggregated decode: requests whose blocks are allocated while their prompt KV
        # arrives over a transfer; not schedulable until `admit_transferred`.
        self.transferring: dict[str, Request] = {}

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        max_tokens = self.kv.num_blocks * self.kv.block_size
        if request.num_tokens >= min(self.config.max_model_len, max_tokens):
            raise ValueError(f"prompt has {request.num_tokens} tokens; the limit is "
                             f"{min(self.config.max_model_len, max_tokens) - 1}")
        token_budget = getattr(self.budget_policy, "max_num_batched_tokens", None)
        if not self.config.enable_chunked_prefill and token_budget and \
                request.num_tokens > token_budget:
            raise ValueError(f"prompt has {request.num_tokens} tokens, more than "
                             f"max_num_batched_tokens ({token_budget}) with chunked prefill off")
        request.max_model_len = self.config.max_model_len
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop from a stop string) requests; unknown ids are ignored."""
        done = []
        for request_id in request_ids:
            if request_id in self.transferring:
                self.cancel_transfer(request_id)
                continue
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            done.append(request)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- disaggregated decode: admit a request prefilled elsewhere -------------------------
    def allocate_for_transfer(self, request: Request) -> list[int] | None:
        """Allocate blocks for a prompt whose KV will be written by a transfer; None when the
        cache has no room now, or max_num_seqs sequences run or arrive (nothing changes). `request.output_token_ids` holds the token
        sampled by the prefill worker. The blocks join the prefix cache only on admission."""
        if request.request_id in self.requests or request.request_id in self.transferring:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(f"request has {request.num_tokens} tokens; the limit is "
                             f"{self.config.max_model_len - 1}")
        request.max_model_len = self.config.max_model_len
        request.num_computed_tokens = 0
        if len(self.running) + len(self.transferring) >= self.config.max_num_seqs:
            return None  # admitting it would run more than max_num_seqs sequences
        if not self.kv.allocate_slots(request, request.num_prompt_tokens, cache_blocks=False):
            return None
        self.transferring[request.request_id] = request
        return self.kv.block_ids(request.request_id)

    def admit_transferred(self, request_id: str) -> Request:
        """The prompt KV has been written: the request becomes a running decode (its next
        step computes the first sampled token's KV and samples the second)."""
        request = self.transferring.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = request.num_prompt_tokens
        self.kv.cache_computed_blocks(request, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        self.requests[request_id] = request
        self.running.append(request)
        return request

    def cancel_transfer(self, request_id: str) -> None:
        """Free the blocks of a transfer that failed or was aborted; unknown ids are ignored."""
        request = self.transferring.pop(request_id, None)
        if request is not None:
            request.status = RequestStatus.FINISHED_ABORTED
            self.kv.free(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        budget = self.budget_policy.new_step()
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []

        # Running decodes first, then running prefill chunks (Sarathi's decode-maximal
        # batching): a step always serves its decodes; prefill chunks get what the budget leaves.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for request in order:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = self._fit_running(budget, request)
            if num_new == 0:
                continue
            self.kv.trim(request, request.num_computed_tokens)  # blocks of rejected drafts
            while not self._allocate(request, num_new):
                # Preempt strictly by admission order (newest first), even if the victim was
                # already scheduled this step: then it is unscheduled and the budget replayed.
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                if any(r is victim for r, _ in scheduled):
                    scheduled = [(r, n) for r, n in scheduled if r is not victim]
                    budget = self._replay_budget(scheduled)
                    num_new = self._fit_running(budget, request)
            else:
                self._consume(budget, request, num_new)
                scheduled.append((request, num_new))

        if not preempted:
            self._schedule_waiting(budget, scheduled)

        output = SchedulerOutput(
            scheduled=[self._make_scheduled(r, n) for r, n in scheduled],
            num_batched_tokens=sum(n for _, n in scheduled),
            preempted_request_ids=preempted,
            finished_request_ids=self._finished_ids,
            predicted_step_time_s=budget.predicted_time_s,
        )
        self._finished_ids = []
        return output

    def _replay_budget(self, scheduled: list[tuple[Request, int]]) -> StepBudget:
        budget = self.budget_policy.new_step()
        for request, num_new in scheduled:
            self._consume(budget, request, num_new)
        return budget

    @staticmethod
    def _is_verification(request: Request) -> bool:
        return bool(request.spec_token_ids) and request.num_tokens - request.num_computed_tokens == 1

    def _fit_running(self, budget: StepBudget, request: Request) -> int:
        """Tokens of a running request that fit: its next chunk, or its last token plus as
        many of its draft tokens as the budget allows."""
        if not self._is_verification(request):
            return budget.fit_chunk(request.num_computed_tokens,
                                    request.num_tokens - request.num_computed_tokens)
        return budget.fit_chunk(request.num_computed_tokens, 1 + len(request.spec_token_ids),
                                decode=True)

    def _consume(self, budget: StepBudget, request: Request, num_new: int) -> None:
        if num_new > 1 and self._is_verification(request):
            budget.consume(request.num_computed_tokens, num_new, decode=True)
        else:
            budget.consume(request.num_computed_tokens, num_new)

    def _allocate(self, request: Request, num_new: int, hit=None) -> bool:
        """allocate_slots, with lookahead slots when the chunk samples and they fit."""
        end = request.num_computed_tokens if hit is None else hit.num_tokens
        end += num_new
        lookahead = 0
        if end >= request.num_tokens:
            lookahead = min(self.config.num_lookahead_tokens, self.config.max_model_len - end)
        if lookahead > 0 and self.kv.allocate_slots(request, num_new, hit,
                                                    num_lookahead_tokens=lookahead):
            return True
        return self.kv.allocate_slots(request, num_new, hit)

    def _schedule_waiting(self, budget: StepBudget, scheduled: list[tuple[Request, int]]) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self.kv.find_prefix(request)
            num_computed = hit.num_tokens
            remaining = request.num_tokens - num_computed
            num_new = budget.fit_chunk(num_computed, remaining)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                if scheduled:
                    break
                num_new = remaining  # alone in the step it may exceed the budget, or never run
            if num_new == 0:
                break
            request.num_computed_tokens = num_computed  # 0 unless the cache hit
            if not self._allocate(request, num_new, hit):
                request.num_computed_tokens = 0
                if not self.running and not self.transferring:
                    # Every block is free or evictable and it still does not fit: it never will.
                    self.waiting.popleft()
                    self._finish(request, RequestStatus.FINISHED_LENGTH)
                    self._finished_outside_update.append(request)
                    continue
                break
            self.kv.record_prefix_query(request.num_tokens, num_computed)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget.consume(num_computed, num_new)
            scheduled.append((request, num_new))

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        num_known = min(num_new, request.num_tokens - start)
        num_drafts = num_new - num_known  # > 0 only for a verification
        sample = start + num_known == request.num_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + num_known]
            + request.spec_token_ids[:num_drafts],
            num_computed_tokens=start,
            block_ids=self.kv.block_ids(request.request_id),
            sample=sample,
            sampling_params=request.sampling_params,
            num_output_tokens=request.num_output_tokens,
            eos_token_ids=request.eos_token_ids,
            num_draft_tokens=num_drafts,
            history_token_ids=list(request.all_token_ids)
            if sample and request.sampling_params.needs_history else None,
            prompt_logprob_token_ids=self._prompt_logprob_targets(request, start, num_known),
        )

    @staticmethod
    def _prompt_logprob_targets(request: Request, start: int, num_known: int) -> list[int] | None:
        """The prompt tokens rows start.. of a chunk predict (None: none asked or left)."""
        end = min(start + num_known + 1, request.num_prompt_tokens)
        if not request.needs_prompt_logprobs or end <= start + 1:
            return None
        return request.prompt_token_ids[start + 1:end]

    # ---- speculative decoding --------------------------------------------------------------
    def max_num_drafts(self, request: Request) -> int:
        """Draft tokens worth verifying for `request` next step: the verification's positions
        stay inside max_model_len, and it emits at most the tokens max_tokens still allows."""
        room = self.config.max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return max(0, room)

    def set_draft_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Draft tokens to verify when `request_id` next runs (cut to `max_num_drafts`);
        ignored unless it is a running decode."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING \
                or request.num_tokens - request.num_computed_tokens != 1:
            return
        request.spec_token_ids = list(token_ids[:self.max_num_drafts(request)])

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        # A victim already scheduled this step had its chunk's blocks registered, but the
        # step will not compute them: they must not be found as a prefix.
        self.kv.uncache_uncomputed_blocks(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def reset_failed_step(self, output: SchedulerOutput) -> None:
        """Undo `output` after its execution failed (no result applied). Its requests' new
        blocks may hold partial KV: they leave the prefix cache, and every request the step
        scheduled goes back to waiting to be recomputed (one may have hit another's new
        blocks in the same step; their computed full blocks stay cached, so it is cheap)."""
        requests = [r for s in output.scheduled
                    if (r := self.requests.get(s.request_id)) is not None
                    and r.status == RequestStatus.RUNNING]
        for request in requests:
            self.kv.uncache_uncomputed_blocks(request)
        for request in reversed(requests):  # appendleft: keep their order at the front
            self.running.remove(request)
            self.kv.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.spec_token_ids = []
            self.waiting.appendleft(request)
        # The runner never saw these: hand them to the next step's output.
        self._finished_ids = output.finished_request_ids + self._finished_ids

    # ---- results ---------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, result: StepResult) -> SchedulerUpdate:
        update = SchedulerUpdate(finished=self._finished_outside_update)
        self._finished_outside_update = []
        if output.predicted_step_time_s is not None and result.step_time_s > 0:
            self.budget_policy.observe_step(output.predicted_step_time_s, result.step_time_s)
        for sched in output.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None or request.is_finished or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted after scheduling
            request.num_computed_tokens += sched.num_new_tokens
            if not sched.sample:
                continue
            request.spec_token_ids = []  # verified now, or not scheduled: stale either way
            token_ids = self._step_tokens(sched, result)
            request.num_computed_tokens -= sched.num_draft_tokens - (len(token_ids) - 1)
            new_ids = update.new_token_ids[sched.request_id] = []
            for token_id in token_ids:  # stops apply token by token, as without drafts
                request.append_output_token(token_id)
                new_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
                    update.finished.append(request)
                    break
        return update

    def _step_tokens(self, sched: ScheduledRequest, result: StepResult) -> list[int]:
        """The tokens a sampling request emits this step: its accepted drafts, then the
        target's own token (just that token without drafts)."""
        token_ids = result.verified_token_ids.get(sched.request_id)
        if token_ids is None:
            token_ids = [result.sampled_token_ids[sched.request_id]]
        num_accepted = len(token_ids) - 1
        if not 0 <= num_accepted <= sched.num_draft_tokens or \
                token_ids[:num_accepted] != sched.draft_token_ids[:num_accepted]:
            raise ValueError(f"request {sched.request_id!r}: verified tokens {token_ids} do not "
                             f"start with its drafts {sched.draft_token_ids}")
        if sched.num_draft_tokens:
            self.spec_stats.observe(sched.num_draft_tokens, num_accepted)
        return token_ids

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                request.stop_token_id = token_id
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_token_id = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self._finished_ids.append(request.request_id)
        del self.requests[request.request_id]

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            assert request.request_id in self.kv.req_blocks
            table = self.kv.req_blocks[request.request_id]
            assert len(table) * self.kv.block_size >= request.num_computed_tokens
            if request.spec_token_ids:  # drafts follow the one known, uncomputed token
                assert request.num_tokens - request.num_computed_tokens == 1
                assert len(request.spec_token_ids) <= self.max_num_drafts(request)
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not request.spec_token_ids
            assert request.request_id not in self.kv.req_blocks
        for request_id in self.transferring:
            assert request_id in self.kv.req_blocks and request_id not in self.requests
        assert set(self.requests) == {r.request_id for r in self.running} | \
            {r.request_id for r in self.waiting}
