"""Step faults in disaggregated workers, without a model: the debug hook's per-role seeds, and
how the front turns a worker's error into the client's error."""
from __future__ import annotations

import pytest

from deepinfer.clients.disagg_track import _worker_error
from deepinfer.engine.step_faults import DebugStepFault
from deepinfer.engine.exceptions import EngineDeadError, RequestFailedError
from deepinfer.wire.engine_messages import RequestError
from tests.unit.test_step_fault_pinning import batch


def test_debug_seeds_apply_to_their_role_only(monkeypatch):
    monkeypatch.setenv("DEEPINFER_DEBUG_STEP_FAULT_SEED", "prefill:7, decode:8,9")
    assert DebugStepFault.from_env("prefill").seeds == {7, 9}
    assert DebugStepFault.from_env("decode").seeds == {8, 9}
    assert DebugStepFault.from_env().seeds == {9}  # a colocated engine: bare seeds only
    hook = DebugStepFault.from_env("decode")
    hook.check(batch("a", seeds={"a": 7}))  # the prefill worker's seed
    with pytest.raises(RuntimeError, match="injected fault for request b"):
        hook.check(batch("a", "b", seeds={"b": 8}))


def test_a_failed_step_is_a_request_failure_not_a_bad_request():
    failed = RequestError("r", "the engine failed while running this request", failed=True)
    for streamed in (0, 3):  # before or after the first token
        error = _worker_error(failed, streamed)
        assert isinstance(error, RequestFailedError) and not error.engine_fault
    refused = RequestError("r", "the prompt is empty")
    assert isinstance(_worker_error(refused, 0), ValueError)
    assert isinstance(_worker_error(refused, 1), EngineDeadError)


def test_a_corrupt_frame_is_skipped_and_the_next_message_read():
    """The front's output loops (engine client, P/D cluster, encode stage) share this receive:
    a frame that does not decode is logged and skipped, the loop reads on."""
    import asyncio

    import zmq
    import zmq.asyncio

    from deepinfer.wire.engine_messages import EngineDead, make_encoder, make_engine_decoder
    from deepinfer.wire.inbox import receive_message

    async def exchange():
        ctx = zmq.asyncio.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind("inproc://receive-test")
        push.connect("inproc://receive-test")
        decode = make_engine_decoder().decode
        try:
            await push.send(b"\xc1 not msgpack")
            await push.send(make_encoder().encode(EngineDead("boom")))
            return [await receive_message(pull, decode, "test") for _ in range(2)]
        finally:
            push.close(linger=0)
            pull.close(linger=0)
            ctx.term()

    bad, good = asyncio.run(exchange())
    assert bad is None and good == EngineDead("boom")
