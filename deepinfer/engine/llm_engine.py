"""LLMEngine: one engine loop (scheduler + model runner) and the output processing around it."""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.request import Request, RequestStatus
from deepinfer.core.scheduler import Scheduler, SchedulerConfig, SchedulerUpdate
from deepinfer.core.scheduler_output import StepResult
from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.engine.engine_startup import (attach_images, build_budget_policy, eos_token_ids,
                                            fit_max_model_len, freeze_startup_objects,
                                            load_engine_model, num_blocks_for_memory,
                                            resolve_device)
from deepinfer.engine.grammar_admission import GrammarAdmission
from deepinfer.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from deepinfer.engine.request_checks import check_prompt, check_token_ids, resolve_max_tokens
from deepinfer.engine.request_state import RequestState, SequenceState
from deepinfer.engine.step_faults import DebugStepFault, RequestFailure, describe, pin_step_fault
from deepinfer.engine.step_stats import StepStats
from deepinfer.runtime.grammar_mask import GrammarMasker
from deepinfer.runtime.kv_cache_spec import allocate_kv_cache, kv_bytes_per_token, kv_cache_spec_for
from deepinfer.runtime.model_runner import ModelRunner
from deepinfer.runtime.model_source import ModelSource, resolve_model
from deepinfer.sampling_params import SamplingParams, resolve_bad_words
from deepinfer.structured.grammars import GrammarCache

logger = logging.getLogger(__name__)

# Failed steps in a row before the engine gives up and raises (its process is restarted):
# a fault that survives failing every request in flight is not going away by itself.
MAX_FAILED_STEPS_IN_ROW = 3

# An engine whose only requests wait for their grammar waits this long for a compile to end
# per step instead of spinning.
GRAMMAR_WAIT_S = 0.005


class LLMEngine:
    # A loop that reports `take_request_failures()` sets this: a step that raises then fails
    # only the requests it can be pinned on (or, if none, every request in flight) instead of
    # raising. Off, e.g. for expert-parallel ranks whose steps must stay in lockstep.
    isolate_step_faults = False
    # False: `step` returns outputs of finished requests only (offline generation reads no
    # others), saving a snapshot of every running request's output per step.
    stream_outputs = True

    def __init__(self, config: EngineConfig, *, source: ModelSource | None = None,
                 model: torch.nn.Module | None = None, tokenizer=None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = getattr(torch, config.dtype)
        self.source = source or resolve_model(config.model)
        self.model_config = self.source.config
        self.model_name = config.served_model_name or self.source.name
        self.tokenizer = tokenizer or self.source.load_tokenizer()
        if model is None:
            model = load_engine_model(self.source, config, self.dtype, self.device)
        self.model = model
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        spec = kv_cache_spec_for(self.model_config, config.block_size, self.dtype)  # MHA/GQA or MLA latent
        spec_config = config.speculative_config
        self.draft_kv_spec = None  # a draft model's / MTP layer's own KV, one block per block
        if spec_config is not None:
            from deepinfer.spec.speculator import draft_kv_cache_spec
            self.draft_kv_spec = draft_kv_cache_spec(spec_config, self.source, self.model_config,
                                                     config.block_size, self.dtype)
        num_blocks = config.num_kv_blocks or num_blocks_for_memory(
            config.kv_cache_memory, spec, self.draft_kv_spec)
        self.max_model_len = fit_max_model_len(self.max_model_len, config.max_model_len,
                                               num_blocks * config.block_size)
        self.cache = allocate_kv_cache(spec, num_blocks, self.device)
        logger.info("KV cache: %d bytes per token (%s), %d blocks hold %d tokens",
                    kv_bytes_per_token(spec), "MLA latent" if self.model_config.mla else "K/V heads",
                    num_blocks, num_blocks * config.block_size)
        self.runner = ModelRunner(self.model, self.cache, self.device, config.seed)
        self.runner.sampler.logprobs_mode = config.logprobs_mode
        # Vision-language models: requests' images, the embedding cache and the runner's splice.
        self.mm_images = attach_images(self.model, self.device, self.runner)
        self.embedding_cache = self.mm_images.cache if self.mm_images is not None else None
        kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self.max_model_len, config.enable_chunked_prefill,
                            num_lookahead_tokens=spec_config.num_lookahead_tokens
                            if spec_config else 0),
            kv_manager, build_budget_policy(config, self.runner, self.model_config))
        self.speculator = None  # speculative decoding: drafts after every step
        if spec_config is not None:
            from deepinfer.spec.speculator import build_speculator
            self.speculator = build_speculator(spec_config, self)
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        # Structured outputs: grammars compiled against this vocabulary (on first use).
        self.grammar_cache = GrammarCache(self.tokenizer, self.model_config.vocab_size,
                                          list(self.eos_token_ids))
        self.runner.sampler.grammar = GrammarMasker(self.grammar_cache)
        self.grammar_admission = GrammarAdmission(self.grammar_cache)
        self._states: dict[str, RequestState] = {}
        self._child_parent: dict[str, str] = {}
        self.step_stats = StepStats()
        self._failures: list[RequestFailure] = []
        self._token_texts: dict[int, str] = {}
        self._num_failed_steps_in_row = 0
        self.num_failed_steps = 0
        self.num_failed_requests = 0
        self.debug_fault = DebugStepFault.from_env()
        freeze_startup_objects()
        logger.info("engine ready: %s %s on %s, %d KV blocks of %d tokens", self.model_name,
                    config.dtype, self.device, num_blocks, config.block_size)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, prompt: str | None = None,
                    mm_inputs=None) -> None:
        """Queue a request. Raises ValueError (nothing queued) for bad input. `mm_inputs`: the
        prompt's images (deepinfer.wire.mm_inputs.MultiModalInputs)."""
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = check_prompt(prompt_token_ids, self.model_config.vocab_size,
                                        self.max_model_len)
        images = self._check_images(prompt_token_ids, mm_inputs)
        params = resolve_bad_words(params, self.tokenizer)
        check_token_ids(params, self.model_config.vocab_size, self.eos_token_ids)
        params = resolve_max_tokens(params, len(prompt_token_ids), self.max_model_len)
        grammar_compile = self.grammar_admission.prepare(params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, prompt_token_ids, params, RequestMetrics(arrival), prompt)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = dataclasses.replace(params, n=1, seed=seed)
            children.append(Request(child_id, list(prompt_token_ids), child_params, arrival,
                                    self.eos_token_ids))
            if mm_inputs is not None:
                children[-1].mm_placeholders = list(mm_inputs.placeholders)
            detok = IncrementalDetokenizer.for_request(self.tokenizer, prompt_token_ids, params)
            output = CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None,
                                      cumulative_logprob=0.0 if params.logprobs is not None else None)
            state.sequences[child_id] = SequenceState(i, detok, output)
        if grammar_compile is None:
            self._schedule_children(children)
        else:
            self.grammar_admission.hold(request_id, grammar_compile, children)
        self._states[request_id] = state
        for child in children:
            self._child_parent[child.request_id] = request_id
        if images is not None:
            self.mm_images.add([child.request_id for child in children], images, mm_inputs)

    def _schedule_children(self, children: list[Request]) -> None:
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar finished compiling (fail those it could not)."""
        idle = not self.scheduler.has_unfinished_requests()
        for request_id, children, error in self.grammar_admission.take_ready(
                GRAMMAR_WAIT_S if idle else 0.0):
            if request_id not in self._states:
                continue  # aborted while compiling
            try:
                if error is not None:
                    raise error
                self._schedule_children(children)
            except Exception as exc:
                self._fail(request_id, f"the request's structured output grammar could not be "
                                       f"used: {describe(exc)}")

    def _check_images(self, prompt_token_ids: list[int], mm_inputs):
        if mm_inputs is None or not mm_inputs.placeholders:
            if self.mm_images is not None and self.mm_images.image_token_id in prompt_token_ids:
                raise ValueError("the prompt has image tokens but no images")
            return None
        if self.mm_images is None:
            raise ValueError(f"model {self.model_name} does not accept images")
        return self.mm_images.check(prompt_token_ids, mm_inputs)

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is None:
                continue
            self.grammar_admission.drop(request_id)
            self.scheduler.finish_requests(list(state.sequences), RequestStatus.FINISHED_ABORTED)
            for child_id in state.sequences:
                self._child_parent.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    # ---- for engines that admit requests prepared elsewhere (disaggregated decode) ----------
    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def check_request(self, prompt_token_ids: list[int],
                      params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompt and params `add_request` would queue (max_tokens resolved); ValueError
        for bad input. Records nothing."""
        prompt_token_ids = check_prompt(prompt_token_ids, self.model_config.vocab_size,
                                        self.max_model_len)
        params = resolve_bad_words(params, self.tokenizer)
        if params.structured_outputs is not None:  # the caller schedules it at once
            self.grammar_cache.get(params.structured_outputs)
        return prompt_token_ids, resolve_max_tokens(params, len(prompt_token_ids),
                                                    self.max_model_len)

    def adopt_request_state(self, state: RequestState) -> None:
        """Track (detokenize, stream, abort) a request whose sequences the caller has put in
        the scheduler itself; each sequence id in `state.sequences` maps to it."""
        self._states[state.request_id] = state
        for child_id in state.sequences:
            self._child_parent[child_id] = state.request_id

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if len(self.grammar_admission):
            self._admit_compiled()
            if not self.scheduler.has_unfinished_requests():
                return []
        now = time.monotonic()
        sched_out = self.scheduler.schedule(now)
        for s in sched_out.scheduled:
            state = self._states.get(self._child_parent.get(s.request_id, ""))
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                state.num_cached_tokens = self.scheduler.requests[s.request_id].num_cached_tokens or 0
        try:
            result = self._execute(sched_out)
        except Exception as exc:
            if not self.isolate_step_faults:
                self._undo_step(sched_out)  # whoever catches this may step again
                raise
            self._recover_failed_step(sched_out, exc)
            return []
        self._num_failed_steps_in_row = 0
        update = self.scheduler.update(sched_out, result)
        self.step_stats.record(sched_out.predicted_step_time_s, result.step_time_s)
        outputs = self._process(update, result, time.monotonic())
        if self.speculator is not None:
            self.speculator.propose(sched_out)  # drafts for the next step
        return outputs

    def _execute(self, output) -> StepResult:
        """Run one step's batch (also a failed step's requests alone, to pin the fault)."""
        self.debug_fault.check(output)
        if self.mm_images is not None:  # encode the images this step's chunks cover
            self.mm_images.prepare(output.scheduled, self.scheduler.requests)
        return self.runner.execute(output)

    def _recover_failed_step(self, output, exc: Exception) -> None:
        """Fail the requests the fault is pinned on (or every request in flight), undo the
        step for the rest (they are recomputed) and carry on. Raises `exc` after
        MAX_FAILED_STEPS_IN_ROW failed steps in a row."""
        self.num_failed_steps += 1
        self._num_failed_steps_in_row += 1
        if self._num_failed_steps_in_row > MAX_FAILED_STEPS_IN_ROW:
            logger.error("%d engine steps in a row failed; giving up", MAX_FAILED_STEPS_IN_ROW)
            self._undo_step(output)
            raise exc
        logger.exception("engine step failed (%d requests scheduled)", len(output.scheduled))
        culprits = pin_step_fault(self._execute, output, exc)
        self._undo_step(output)
        if culprits:
            failed = {}
            for child_id, error in culprits.items():
                parent = self._child_parent.get(child_id)
                if parent is not None:
                    failed.setdefault(parent, error)
            for request_id, error in failed.items():
                logger.error("request %s failed in the engine: %s", request_id, error)
                self._fail(request_id, f"the engine failed while running this request "
                                       f"({error}); other requests were not affected")
            return
        error = describe(exc)
        logger.error("engine step failed for no single request; failing all %d in flight: %s",
                     len(self._states), error)
        for request_id in list(self._states):
            self._fail(request_id, f"an engine step failed ({error}); every request in flight "
                                   "was stopped and the engine was reset", engine_fault=True)
        self.scheduler.kv.pool.reset_prefix_cache()  # nothing in use: start from a clean cache

    def _undo_step(self, output) -> None:
        """Nothing of a failed step is applied: its requests are recomputed, and no block it
        left partial stays in the prefix cache."""
        self.scheduler.reset_failed_step(output)
        if self.speculator is not None:  # drafter state of the undone step is stale
            self.speculator.forget([s.request_id for s in output.scheduled]
                                   + output.preempted_request_ids + output.finished_request_ids)

    def _fail(self, request_id: str, message: str, engine_fault: bool = False) -> None:
        self.abort_request([request_id])
        self.num_failed_requests += 1
        self._failures.append(RequestFailure(request_id, message, engine_fault))

    def take_request_failures(self) -> list[RequestFailure]:
        """Requests the engine dropped with an error since the last call (see
        `isolate_step_faults`); each must be answered with its error."""
        failures, self._failures = self._failures, []
        return failures

    def _process(self, update: SchedulerUpdate, result: StepResult, now: float) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        for child_id, chunk in result.prompt_logprobs.items():
            state = self._states.get(self._child_parent.get(child_id, ""))
            if state is not None:
                state.add_prompt_logprobs(chunk, self.token_text)
        ended = {request.request_id: request for request in update.finished}
        for child_id, token_ids in update.new_token_ids.items():
            state = self._states.get(self._child_parent.get(child_id, ""))
            if state is None:
                continue
            seq = state.sequences[child_id]
            try:
                self._append_tokens(child_id, seq, token_ids, result, ended.get(child_id))
            except Exception as exc:  # e.g. its detokenizer: this request's fault alone
                if not self.isolate_step_faults:
                    raise
                logger.exception("request %s: output processing failed", state.request_id)
                self._fail(state.request_id, f"the engine failed on this request's output "
                                             f"({describe(exc)}); other requests were not "
                                             "affected")
                touched.pop(state.request_id, None)
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            touched[state.request_id] = state
        for request in update.finished:
            state = self._states.get(self._child_parent.get(request.request_id, ""))
            if state is None:
                continue
            seq = state.sequences[request.request_id]
            if seq.output.finish_reason is None:
                seq.output.finish_reason = request.status.finish_reason
                seq.output.stop_reason = request.stop_token_id if (
                    request.stop_token_id is not None
                    and request.stop_token_id not in request.eos_token_ids) else None
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                self._release(state)
            if finished or self.stream_outputs:
                outputs.append(state.to_output(finished))
        return outputs

    def _append_tokens(self, child_id: str, seq, token_ids: list[int], result: StepResult,
                       end: Request | None) -> None:
        logprobs = result.verified_logprobs.get(child_id)
        if logprobs is None:
            lp = result.logprobs.get(child_id)
            logprobs = [] if lp is None else [lp]
        if seq.append_tokens(token_ids, logprobs, end is not None,
                             end is not None and end.stop_token_id is not None) is not None:
            self.scheduler.finish_requests([child_id], RequestStatus.FINISHED_STOPPED)

    def token_text(self, token_id: int) -> str:
        """One token's text (memoised: prompt log-probs name many tokens, often the same)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _release(self, state: RequestState) -> None:
        self._states.pop(state.request_id, None)
        for child_id in state.sequences:
            self._child_parent.pop(child_id, None)

    # ---- stats -----------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage, num_kv_blocks_used=kv.pool.num_used_blocks,
            num_kv_blocks_total=kv.num_blocks, prefix_cache_queries=kv.num_prefix_queries,
            prefix_cache_hits=kv.num_prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            **dataclasses.asdict(self.step_stats),
            spec_decode_num_drafts=self.scheduler.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.scheduler.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.scheduler.spec_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(
                self.scheduler.spec_stats.num_accepted_tokens_per_pos))
