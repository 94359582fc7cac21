"""Typed messages of the disaggregated cluster (msgpack via msgspec).

    front ──ClusterInput──▶ worker           PUSH/PULL, one channel per worker
    front ◀──WorkerMessage── every worker    PUSH/PULL, one shared channel
    decode ──KVPull──▶ prefill (ROUTER)      DEALER/ROUTER: KV blocks come back as raw frames

A prefill worker answers a `PrefillRequest` with the first token (a `RequestDelta` in its
`WorkerReport`) and, unless that token finished the request, a `PrefillDone` naming where its
KV can be pulled. The front routes a `DecodeRequest` to a decode worker, which allocates
blocks, pulls the KV, and streams the rest. Every `WorkerReport` doubles as a heartbeat; a
heartbeat thread also sends `WorkerHeartbeat` while a long step runs.
Output deltas reuse the colocated server's `RequestDelta` (wire.engine_messages).
"""
from __future__ import annotations

import msgspec

from deepinfer.core.scheduler_output import TokenLogprobs
from deepinfer.wire.mm_inputs import MultiModalInputs
from deepinfer.sampling_params import SamplingParams
from deepinfer.wire.engine_messages import RequestDelta, RequestError
from deepinfer.wire.tokenizer_files import TokenizerFiles

# --- front -> worker -----------------------------------------------------------------------


class PrefillRequest(msgspec.Struct, tag=True):
    """`num_await_blocks`: leading prompt blocks another prefill worker is computing now;
    wait up to `await_timeout_s` for them to be published in the shared store rather than
    compute them again (the router's `PrefixPlan`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    num_await_blocks: int = 0
    await_timeout_s: float = 0.0
    # Image placeholders; without pixels when an encode worker put the embeddings in the
    # shared store (the prefill worker fetches them by image hash).
    mm_inputs: MultiModalInputs | None = None


class DecodeRequest(msgspec.Struct, tag=True):
    """Continue a prefilled request: pull its prompt KV from `kv_source_addr`, then decode.

    `first_token_id` was sampled by the prefill worker and already streamed; the decode
    worker's delta tracker starts after it (`num_text_chars_sent` characters were sent)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    first_token_id: int
    first_logprob: TokenLogprobs | None
    num_text_chars_sent: int
    kv_source_addr: str
    num_kv_bytes: int
    num_cached_tokens: int = 0  # prefix hit on the prefill worker (for usage reporting)
    # Image placeholders, no pixels: block hashes as on the prefill worker, and a recompute
    # after preemption takes the embeddings by image hash (cache, shared store) or fails.
    mm_inputs: MultiModalInputs | None = None


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class ShutdownWorker(msgspec.Struct, tag=True):
    pass


class DebugHangLoop(msgspec.Struct, tag=True):
    """Fault injection (tests, chaos runs): the engine loop stops advancing until the file
    `release_path` exists or `max_s` pass; the heartbeat thread keeps beating meanwhile."""

    release_path: str
    max_s: float = 600.0


ClusterInput = PrefillRequest | DecodeRequest | AbortRequests | ShutdownWorker | DebugHangLoop

# --- worker -> front -----------------------------------------------------------------------


class WorkerReady(msgspec.Struct, tag=True):
    worker_id: str
    role: str
    pid: int
    kv_addr: str | None  # prefill: where decode workers pull KV
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    tokenizer_files: TokenizerFiles
    # `ModelSource.weights_fingerprint()`: KV moves between workers only if theirs are equal.
    weights_fingerprint: str = ""


class PrefillDone(msgspec.Struct):
    """The prompt KV of `request_id` is staged at `kv_addr` until pulled or expired."""

    request_id: str
    first_token_id: int
    first_logprob: TokenLogprobs | None
    num_text_chars_sent: int
    kv_addr: str
    num_kv_bytes: int
    num_cached_tokens: int = 0


class WorkerLoadReport(msgspec.Struct):
    """`routing.WorkerLoad` without the router's clock (the front stamps it on arrival)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_queued_uncached_tokens: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    block_size: int
    kv_tokens: int
    max_running_reqs: int
    kv_staged_bytes: int = 0  # prefill: staged + promised to admitted prompts
    kv_staging_capacity_bytes: int = 0  # prefill: the cap (0: none reported)
    store_load_s_per_token: float | None = None  # prefill: measured shared-store read rate
    compute_s_per_token: float | None = None  # prefill: measured prefill compute rate


class WorkerCounters(msgspec.Struct):
    """Cumulative counters of one worker (metrics)."""

    prefix_query_tokens: int = 0
    device_hit_tokens: int = 0
    store_hit_tokens: int = 0  # loaded from the shared store (fs, redis)
    host_hit_tokens: int = 0  # loaded from the worker's host-memory tier
    store_loads_skipped: int = 0  # prompts whose stored prefix was recomputed (cheaper)
    store_read_timeouts: int = 0  # prompts admitted at their read deadline (rest recomputed)
    store_await_tokens: int = 0  # awaited blocks (computed by another worker) that arrived
    store_blocks_published: int = 0  # blocks queued for the store as their chunk finished
    store_bytes_read: int = 0
    store_bytes_written: int = 0
    store_corrupt_blocks: int = 0
    transfer_bytes: int = 0  # sent (prefill) or received (decode)
    num_transfers: int = 0
    num_transfer_failures: int = 0
    transfer_seconds_total: float = 0.0
    num_staged: int = 0  # prefill: KV payloads waiting to be pulled (gauge)
    staged_bytes: int = 0  # gauge
    num_failed_steps: int = 0  # engine steps that raised; the worker carried on
    num_failed_requests: int = 0  # requests failed because of them
    # Where a worker's time goes (the simulator's validation compares them with its steps):
    num_engine_steps: int = 0
    model_step_seconds_total: float = 0.0  # the runner's own time in those steps
    loop_step_seconds_total: float = 0.0  # wall time of step + its output handling + report
    process_cpu_seconds: float = 0.0  # the worker process's CPU time so far (all threads)
    model_step_cpu_seconds_total: float = 0.0  # process CPU time inside those steps (wall -
    # this = time the step was runnable but not running, or blocked)
    idle_wait_seconds_total: float = 0.0  # wall time waiting for input with no step work
    num_prefilled_requests: int = 0  # prefill: prompts finished and handed off
    prefill_computed_tokens: int = 0  # prefill: prompt tokens computed (not cache hits)
    # decode: speculative decoding (summed over workers into the front's spec_decode_* metrics)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # decode: where a request's time between tokens goes (sums; divide by the counts)
    decode_step_running_requests: int = 0  # requests running at each step's start, summed
    decode_step_token_requests: int = 0  # requests each step gave a token, summed
    decode_step_token_seconds_total: float = 0.0  # each step's wall x requests it served
    decode_step_pending_transfers: int = 0  # requests waiting for their KV at each step, summed
    decode_token_gap_seconds_total: float = 0.0  # a request's consecutive emissions here
    decode_token_gaps: int = 0
    decode_alloc_wait_seconds_total: float = 0.0  # DecodeRequest received -> blocks allocated
    decode_fetch_wait_seconds_total: float = 0.0  # blocks allocated -> KV pulled (polled)
    decode_kv_write_seconds_total: float = 0.0  # pulled KV written into the cache
    decode_first_token_wait_seconds_total: float = 0.0  # admitted -> its first token here
    decode_admitted: int = 0  # requests admitted after their transfer
    between_steps_seconds_total: float = 0.0  # before_step: allocations, pulls, KV writes
    wire_frames_dropped: dict[str, int] = {}  # this process's, "channel/reason" -> count


class WorkerReport(msgspec.Struct, tag=True):
    worker_id: str
    load: WorkerLoadReport
    counters: WorkerCounters
    outputs: list[RequestDelta] = []
    errors: list[RequestError] = []
    prefill_done: list[PrefillDone] = []
    kv_received: list[str] = []  # decode: requests whose prompt KV arrived (pull finished)


class WorkerHeartbeat(msgspec.Struct, tag=True):
    """Sent by a worker's heartbeat thread, so a long step is not mistaken for a dead worker.
    `loop_age_s`: time since its engine loop last finished an iteration."""

    worker_id: str
    loop_age_s: float


class WorkerFailed(msgspec.Struct, tag=True):
    worker_id: str
    message: str


WorkerMessage = WorkerReady | WorkerReport | WorkerHeartbeat | WorkerFailed

# --- decode -> prefill KV pull -------------------------------------------------------------


class KVPull(msgspec.Struct):
    request_id: str


class KVPullReply(msgspec.Struct):
    """Header frame; on success the next frame is the raw KV payload."""

    request_id: str
    ok: bool
    shape: list[int] = []
    dtype: str = ""
    message: str = ""


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def cluster_input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ClusterInput)


def worker_message_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(WorkerMessage)
