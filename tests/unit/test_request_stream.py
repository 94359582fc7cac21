"""The per-request bookkeeping every client shares: duplicate ids refused, an engine's error
for a request raised as the front's 500 (failed step) or 400 (refusal), and the disaggregated
front's rule on top (a refusal after tokens were streamed is a lost stream)."""
from __future__ import annotations

import pytest

from deepinfer.clients.disagg_track import _worker_error
from deepinfer.clients.request_stream import StreamFailed, check_new_stream, engine_error
from deepinfer.engine.exceptions import EngineDeadError, RequestFailedError
from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.wire.engine_messages import RequestError


def test_a_request_id_in_flight_is_refused():
    streams = {"a": object()}
    check_new_stream(streams, "b")
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        check_new_stream(streams, "a")


def test_engine_errors_become_the_fronts_exceptions():
    failed = engine_error(RequestError("r", "step raised", failed=True, engine_fault=True))
    assert type(failed) is RequestFailedError and failed.engine_fault
    refused = engine_error(RequestError("r", "too long"))
    assert type(refused) is ValueError and str(refused) == "too long"
    named = engine_error(RequestError("r", "bad top_k", param="top_k"))
    assert isinstance(named, InvalidParameter) and named.param == "top_k"


def test_a_refusal_after_streamed_tokens_is_a_lost_stream():
    refusal = RequestError("r", "pull failed")
    assert type(_worker_error(refusal, 0)) is ValueError
    assert type(_worker_error(refusal, 3)) is EngineDeadError
    assert type(_worker_error(RequestError("r", "x", failed=True), 3)) is RequestFailedError


def test_a_failure_item_carries_whether_its_group_was_lost():
    error = EngineDeadError("gone")
    assert StreamFailed(error).group_lost is False
    assert StreamFailed(error, group_lost=True).error is error
