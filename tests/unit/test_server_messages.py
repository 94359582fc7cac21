"""Front/engine protocol: msgpack round trips, cumulative → delta outputs, stream cursors."""
from __future__ import annotations

from deepinfer.core.scheduler_output import TokenLogprobs
from deepinfer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.cluster.engine_proc import OutputDeltaTracker
from deepinfer.wire.engine_messages import (
    AbortRequest, AddRequest, ChoiceDelta, EngineOutputs, EngineStatsSnapshot, RequestDelta,
    make_encoder, make_engine_decoder, make_front_decoder,
)
from deepinfer.server.serving_base import ChoiceState, StreamCursor


def output(text, ids, finish=None, logprobs=None, request_id="r", index=0):
    return RequestOutput(request_id, [1, 2], [CompletionOutput(index, text, ids, finish,
                                                                logprobs=logprobs)],
                         finished=finish is not None, num_cached_tokens=16,
                         metrics=RequestMetrics(1.0, 1.5, 2.0, 3.0, 3.0))


def test_messages_round_trip_through_msgpack():
    enc = make_encoder()
    params = SamplingParams(temperature=0.0, stop=["x"], max_tokens=3, logprobs=2)
    add = make_front_decoder().decode(enc.encode(AddRequest("a", [5, 6], params, 12.5)))
    assert add == AddRequest("a", [5, 6], params, 12.5)
    assert make_front_decoder().decode(enc.encode(AbortRequest(["a"]))) == AbortRequest(["a"])
    lp = TokenLogprobs(7, -0.5, 1, [7, 8], [-0.5, -1.5])
    out = EngineOutputs([RequestDelta("a", [ChoiceDelta(0, "hi", [7], [lp], "stop", "x")],
                                      True)], stats=EngineStatsSnapshot(num_running=2))
    back = make_engine_decoder().decode(enc.encode(out))
    assert back == out and back.outputs[0].choices[0].logprobs[0] == lp


def test_deltas_concatenate_to_the_cumulative_output():
    tracker = OutputDeltaTracker()
    tracker.add_request("r", SamplingParams())
    lps = [TokenLogprobs(i, -0.1 * i, 1, [i], [-0.1 * i]) for i in range(3)]
    steps = [output("He", [10], logprobs=lps[:1]), output("Hello", [10, 11], logprobs=lps[:2]),
             output("Hello!", [10, 11, 12], "length", logprobs=lps)]
    deltas = [tracker.to_delta(o) for o in steps]
    assert "".join(d.choices[0].text for d in deltas) == "Hello!"
    assert sum((d.choices[0].token_ids for d in deltas), []) == [10, 11, 12]
    assert sum((d.choices[0].logprobs for d in deltas), []) == lps
    assert [d.finished for d in deltas] == [False, False, True]
    assert deltas[0].times is None and deltas[-1].times.first_scheduled_time == 1.5
    assert deltas[-1].num_cached_tokens == 16


def test_stop_string_tail_is_held_back_until_the_engine_cuts_it():
    tracker = OutputDeltaTracker()
    tracker.add_request("r", SamplingParams(stop=["\n\n"]))
    # The engine's cumulative text grows to "Hello\n", then the stop cuts it back to "Hello".
    steps = [output("Hello", [1]), output("Hello\n", [1, 2]), output("Hello", [1, 2, 3], "stop")]
    texts = [tracker.to_delta(o).choices[0].text for o in steps]
    assert texts == ["Hell", "o", ""]
    assert "".join(texts) == "Hello"


def test_stream_cursor_sends_each_piece_once_and_the_final_chunk_once():
    choice, cursor = ChoiceState(0), StreamCursor()
    choice.apply(ChoiceDelta(0, "a", [1]))
    first = cursor.advance(choice)
    assert (first.token_start, first.char_start, first.is_first) == (0, 0, True)
    assert cursor.advance(choice) is None  # nothing new
    choice.apply(ChoiceDelta(0, "bc", [2], finish_reason="length"))
    last = cursor.advance(choice)
    assert (last.token_start, last.char_start, last.is_first) == (1, 1, False)
    assert cursor.advance(choice) is None and cursor.done


def test_resume_continues_a_stream_started_elsewhere():
    tracker = OutputDeltaTracker()
    tracker.resume("r", num_tokens=1, num_text_chars=2)
    delta = tracker.to_delta(output("He said", [10, 11, 12]))
    assert (delta.choices[0].text, delta.choices[0].token_ids) == (" said", [11, 12])
