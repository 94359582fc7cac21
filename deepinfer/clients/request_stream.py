"""What every client keeps per request stream, written once: the id check on the way in, the
failure item its consumer raises, and how an engine's error for a request is raised.

Each client holds `request id -> its record` (a queue, or a record holding one) filled by its
reader task(s); `generate()` yields deltas from it and raises a `StreamFailed`'s error.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepinfer.engine.exceptions import RequestFailedError
from deepinfer.wire.engine_messages import RequestError, rejection_error


@dataclass(frozen=True)
class StreamFailed:
    """Queued to a request's consumer: `generate()` raises `error`. `group_lost`: the rank
    group serving it was lost (a request that streamed nothing may go to another group)."""

    error: Exception
    group_lost: bool = False


def check_new_stream(streams: dict, request_id: str) -> None:
    """ValueError (400) if `request_id` is in flight already: its deltas would go to two
    consumers, and an abort for one would end both."""
    if request_id in streams:
        raise ValueError(f"duplicate request id {request_id!r}")


def engine_error(error: RequestError) -> Exception:
    """An engine's error for one request, as the front raises it: a step that failed while
    running it (500 request_failed), else a refusal of the request (400)."""
    if error.failed:
        return RequestFailedError(error.message, error.engine_fault)
    return rejection_error(error)
