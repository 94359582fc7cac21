"""The engine process: owns an `LLMEngine` and runs its step loop, fed over ZMQ.

    front PUSH ──AddRequest / AbortRequest / Shutdown──▶ PULL ┐
                                                             engine loop (step, step, ...)
    front PULL ◀──────────EngineOutputs (deltas + stats)── PUSH ┘

The loop never waits on the front: between steps it drains whatever messages have arrived
(non-blocking) and sends one `EngineOutputs` per step (deltas of every request that progressed
plus a stats snapshot) on an unbounded PUSH socket. When idle it blocks on the input socket
with a timeout, so it wakes for new work at once and still notices a dead parent.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import zmq

from deepinfer.multimodal.embedding_cache import embedding_stats
from deepinfer.wire.engine_messages import (
    AbortRequest, AddRequest, ChoiceDelta, EngineDead, EngineOutputs, EngineReady,
    EngineStatsSnapshot, FrontMessage, RequestDelta, RequestError, RequestTimes, Shutdown,
)
from deepinfer.wire.inbox import drain_messages
from deepinfer.cluster.process_shell import Serving, run_process
from deepinfer.wire import (PROCESS_DROPS, ChannelReceiver, ChannelSender, TokenizerFiles,
                            channel_name, tokenizer_to_files)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 200  # idle wake-up: parent check and periodic stats
IDLE_STATS_PERIOD_S = 1.0


@dataclass
class _SentChoice:
    """How much of one choice's cumulative output has been sent already."""

    num_tokens: int = 0
    text_len: int = 0
    num_logprobs: int = 0


class OutputDeltaTracker:
    """Turns the engine's cumulative `RequestOutput`s into `RequestDelta`s.

    Stop strings: the engine cuts the text where a stop string appears, which can remove up to
    len(stop) - 1 characters that an earlier step already showed. So until a choice finishes
    its last `max(len(stop)) - 1` characters are held back (as vLLM does when streaming).
    """

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, _SentChoice]] = {}
        self._holdback: dict[str, int] = {}
        self._prompt_logprobs_sent: set[str] = set()

    def add_request(self, request_id: str, params) -> None:
        if params.stop and not params.include_stop_str_in_output:
            self._holdback[request_id] = max(len(s) for s in params.stop) - 1

    def resume(self, request_id: str, num_tokens: int, num_text_chars: int,
               num_logprobs: int = 0, index: int = 0) -> None:
        """Continue a stream another worker started: its first `num_tokens` tokens,
        `num_text_chars` characters and `num_logprobs` logprobs were already sent."""
        self._sent.setdefault(request_id, {})[index] = _SentChoice(
            num_tokens=num_tokens, text_len=num_text_chars, num_logprobs=num_logprobs)
        self._prompt_logprobs_sent.add(request_id)  # the first delta carried them

    def to_delta(self, output) -> RequestDelta:
        sent = self._sent.setdefault(output.request_id, {})
        holdback = self._holdback.get(output.request_id, 0)
        choices = [self._choice_delta(c, sent.setdefault(c.index, _SentChoice()), holdback)
                   for c in output.outputs]
        times = _request_times(output.metrics) if output.finished else None
        prompt_logprobs = output.prompt_logprobs
        if prompt_logprobs is not None and output.request_id not in self._prompt_logprobs_sent:
            self._prompt_logprobs_sent.add(output.request_id)
        else:
            prompt_logprobs = None
        if output.finished:
            self.forget([output.request_id])
        return RequestDelta(request_id=output.request_id, choices=choices,
                            finished=output.finished,
                            num_cached_tokens=int(output.num_cached_tokens or 0), times=times,
                            prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _choice_delta(completion, sent: _SentChoice, holdback: int) -> ChoiceDelta:
        text = completion.text or ""
        if completion.finish_reason is None and holdback:
            text = text[:max(0, len(text) - holdback)]
        new_text = text[sent.text_len:] if len(text) >= sent.text_len else ""
        new_ids = list(completion.token_ids[sent.num_tokens:])
        new_logprobs = None
        if completion.logprobs is not None:
            new_logprobs = list(completion.logprobs[sent.num_logprobs:])
            sent.num_logprobs = len(completion.logprobs)
        sent.text_len = max(sent.text_len, len(text))
        sent.num_tokens = len(completion.token_ids)
        return ChoiceDelta(index=completion.index, text=new_text, token_ids=new_ids,
                           logprobs=new_logprobs, finish_reason=completion.finish_reason,
                           stop_reason=completion.stop_reason,
                           cumulative_logprob=completion.cumulative_logprob)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._sent.pop(request_id, None)
            self._holdback.pop(request_id, None)
            self._prompt_logprobs_sent.discard(request_id)


def _request_times(metrics) -> RequestTimes | None:
    if metrics is None:
        return None
    return RequestTimes(arrival_time=metrics.arrival_time,
                        first_scheduled_time=metrics.first_scheduled_time,
                        first_token_time=metrics.first_token_time,
                        last_token_time=metrics.last_token_time,
                        finished_time=metrics.finished_time)


def _stats_snapshot(engine, num_requests_received: int) -> EngineStatsSnapshot:
    s = engine.get_stats()
    return EngineStatsSnapshot(
        num_running=s.num_running, num_waiting=s.num_waiting,
        kv_cache_usage=float(s.kv_cache_usage), num_kv_blocks_used=s.num_kv_blocks_used,
        num_kv_blocks_total=s.num_kv_blocks_total, prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
        step_time_s=s.step_time_s, predicted_step_time_s=s.predicted_step_time_s,
        prediction_abs_error_sum=s.prediction_abs_error_sum,
        num_predicted_steps=s.num_predicted_steps, num_requests_received=num_requests_received,
        spec_decode_num_drafts=s.spec_decode_num_drafts,
        spec_decode_num_draft_tokens=s.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=s.spec_decode_num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(s.spec_decode_num_accepted_tokens_per_pos),
        num_failed_steps=getattr(engine, "num_failed_steps", 0),
        num_failed_requests=getattr(engine, "num_failed_requests", 0),
        wire_frames_dropped=PROCESS_DROPS.as_report(), **embedding_stats(engine))


class EngineLoop:
    """Busy loop around one engine; `run()` returns when asked to shut down."""

    def __init__(self, engine, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 parent_pid: int | None = None, endpoints: tuple[str, str] = ("", ""),
                 input_type=FrontMessage) -> None:
        """`endpoints`: the (input, output) addresses, which name the signed channels."""
        self.engine = engine
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.tracker = OutputDeltaTracker()
        self.encoder = ChannelSender(channel_name("engine.output", endpoints[1]))
        self.decoder = ChannelReceiver(channel_name("engine.input", endpoints[0]), input_type)
        self.num_requests_received = 0
        self._pending_errors: list[RequestError] = []
        self._stats_dirty = True
        self._last_stats_time = 0.0

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            if not self._drain_inputs(0 if busy else IDLE_POLL_MS):
                return
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                self._take_failures()
                self._send_outputs([self.tracker.to_delta(o) for o in outputs])
            elif self._pending_errors or self._stats_dirty or \
                    time.monotonic() - self._last_stats_time > IDLE_STATS_PERIOD_S:
                self._send_outputs([])
            if not busy and self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("front process is gone; engine exiting")
                return

    def _drain_inputs(self, timeout_ms: int) -> bool:
        """Handle every queued message; False when a Shutdown arrived."""
        return drain_messages(self.input_socket, self.decoder.decode, timeout_ms, self._on_message)

    def _on_message(self, message) -> bool:
        if isinstance(message, Shutdown):
            return False
        self._handle(message)
        return True

    def _handle(self, message: AddRequest | AbortRequest) -> None:
        self._stats_dirty = True
        if isinstance(message, AbortRequest):
            self.engine.abort_request(message.request_ids)
            self.tracker.forget(message.request_ids)
            return
        self.num_requests_received += 1
        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids,
                                    message.sampling_params, arrival_time=message.arrival_time,
                                    mm_inputs=message.mm_inputs)
            self.tracker.add_request(message.request_id, message.sampling_params)
        except ValueError as e:
            self._pending_errors.append(RequestError(message.request_id, str(e),
                                                     param=getattr(e, "param", None)))
        except Exception as e:  # one bad request must not take down every other one
            logger.exception("request %s rejected", message.request_id)
            self._pending_errors.append(RequestError(
                message.request_id, f"the engine cannot run this request: "
                                    f"{type(e).__name__}: {e}"))

    def _take_failures(self) -> None:
        """Requests a failed step dropped (the engine carried on): answer them with errors."""
        for failure in self.engine.take_request_failures():
            self.tracker.forget([failure.request_id])
            self._pending_errors.append(RequestError(
                failure.request_id, failure.message, failed=True,
                engine_fault=failure.engine_fault))
            self._stats_dirty = True

    def _send_outputs(self, deltas: list[RequestDelta]) -> None:
        stats = _stats_snapshot(self.engine, self.num_requests_received)
        message = EngineOutputs(outputs=deltas, errors=self._pending_errors, stats=stats)
        self.output_socket.send(self.encoder.encode(message), copy=False)
        self._pending_errors = []
        self._stats_dirty = False
        self._last_stats_time = time.monotonic()


def run_engine_proc(engine_config, input_addr: str, output_addr: str, parent_pid: int,
                    log_level: str = "WARNING") -> None:
    """Spawn target: load the engine, announce readiness, loop until Shutdown or parent exit."""
    def build(ctx, input_socket, output_socket) -> Serving:
        from deepinfer.engine.llm_engine import LLMEngine

        engine = LLMEngine(engine_config)
        engine.isolate_step_faults = True  # this loop answers take_request_failures()
        loop = EngineLoop(engine, input_socket, output_socket, parent_pid,
                          endpoints=(input_addr, output_addr))
        return Serving(engine_ready(engine), loop.run)

    # a death report the front turns into 5xx and /health 503
    run_process("engine", log_level, input_addr, output_addr, "engine.output", build,
                lambda message: EngineDead(message=message))


def engine_ready(engine, with_tokenizer: bool = True) -> EngineReady:
    """The message that announces an engine process (an EP rank but the first sends no
    tokenizer: the front reads it from rank 0)."""
    return EngineReady(
        model_name=engine.model_name, max_model_len=int(engine.max_model_len),
        vocab_size=int(engine.model_config.vocab_size),
        tokenizer_files=tokenizer_to_files(engine.tokenizer) if with_tokenizer
        else TokenizerFiles())
