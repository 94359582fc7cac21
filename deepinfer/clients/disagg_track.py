"""The disaggregated front's record of one request in flight, and how a worker's error for it
is raised to the front."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from deepinfer.clients.request_stream import engine_error
from deepinfer.engine.exceptions import EngineDeadError
from deepinfer.wire.mm_inputs import MultiModalInputs
from deepinfer.sampling_params import SamplingParams
from deepinfer.wire.engine_messages import RequestError


def _worker_error(error: RequestError, num_tokens_streamed: int) -> Exception:
    """A worker's error as the front raises it: a step that failed while running the request
    (500 request_failed), a refusal before anything was streamed (400), else a lost stream."""
    if error.failed or num_tokens_streamed == 0:
        return engine_error(error)
    return EngineDeadError(error.message)


@dataclass
class _Track:
    """The front's record of one request in flight."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    queue: asyncio.Queue
    phase: str = "prefill"  # -> "decode"
    prefill_worker: str | None = None
    decode_worker: str | None = None
    num_tokens_streamed: int = 0
    num_retries: int = 0
    last_progress: float = 0.0
    kv_pending: bool = False  # staged on the prefill worker, not yet received by decode
    mm_inputs: MultiModalInputs | None = None  # image placeholders (pixels: no encode stage)
    failed: bool = False  # the consumer was handed an error
    aborted: bool = False  # aborts were sent to every worker holding state
