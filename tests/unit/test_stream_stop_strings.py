"""Streaming with stop strings (property test): for any token stream, step grouping (several
tokens per step, as speculation gives) and stop strings, the text the client is streamed
equals the final (non-streamed) text, and that text is the decode of the output tokens cut at
the first stop string. Multi-byte characters split across tokens, several stop strings,
include_stop_str_in_output, min_tokens and n > 1 are all drawn; the disaggregated hand-off
(first token on a prefill worker, the rest on a decode worker) is checked the same way.

The engine's own output path runs: `LLMEngine._process` (detokenizer, stop cut), the engine
process's `OutputDeltaTracker` (what is sent) and the front's `ChoiceState` / `StreamCursor`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.core.request import RequestStatus
from deepinfer.core.scheduler import SchedulerUpdate
from deepinfer.core.scheduler_output import StepResult, TokenLogprobs
from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import CompletionOutput, RequestMetrics
from deepinfer.engine.request_state import RequestState, SequenceState
from deepinfer.sampling_params import SamplingParams
from deepinfer.cluster.engine_proc import OutputDeltaTracker
from deepinfer.server.admission import AdmissionGate
from deepinfer.server.protocol import CompletionRequest
from deepinfer.server.serving_base import ChoiceState, EngineRequestState, StreamCursor
from deepinfer.server.serving_completion import OpenAIServingCompletion

# Byte-level vocabulary: ASCII pieces, whole multi-byte characters and their fragments.
_PIECES = [b"a", b"b", b"c", b"ab", b"bc", b"ca", b" ", b"\n", "é".encode(), "é".encode()[:1],
           "é".encode()[1:], "😀".encode(), "😀".encode()[:1], "😀".encode()[1:3],
           "😀".encode()[3:], "中".encode(), "中".encode()[:2], "中".encode()[2:], b"\xff"]
EOS = len(_PIECES)
VOCAB = _PIECES + [b"<eos>"]
WHOLE = [i for i, p in enumerate(_PIECES) if p.decode("utf-8", errors="replace") != "\ufffd"
         and "\ufffd" not in p.decode("utf-8", errors="replace")]
STOP_ALPHABET = ["a", "b", "c", " ", "é", "😀", "中", "\ufffd"]


class ByteTokenizer:
    """Decodes like a byte-level BPE tokenizer: bytes joined, invalid UTF-8 replaced."""

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS)
                        ).decode("utf-8", errors="replace")




@dataclass
class FakeRequest:
    request_id: str
    status: RequestStatus
    stop_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = (EOS,)


@dataclass
class FakeScheduler:
    finished: list[str] = field(default_factory=list)

    def finish_requests(self, request_ids, status) -> None:
        self.finished.extend(request_ids)


def make_engine() -> LLMEngine:
    engine = LLMEngine.__new__(LLMEngine)  # only the output path: no model, no scheduler
    engine._states, engine._child_parent = {}, {}
    engine.scheduler = FakeScheduler()
    engine.tokenizer = ByteTokenizer()
    return engine


def add_state(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams,
              first_token_ids: dict[str, int] | None = None) -> RequestState:
    state = RequestState(request_id, prompt, params, RequestMetrics(0.0))
    for i in range(params.n):
        child = request_id if params.n == 1 else f"{request_id}#{i}"
        detok = IncrementalDetokenizer.for_request(engine.tokenizer, prompt, params)
        output = CompletionOutput(i, "", [], logprobs=[], cumulative_logprob=0.0)
        if first_token_ids is not None:  # decode worker: the prefill worker's first token
            detok.add_tokens([first_token_ids[child]])
            output = CompletionOutput(i, detok.text, [first_token_ids[child]],
                                      logprobs=[token_logprobs(first_token_ids[child])],
                                      cumulative_logprob=-1.0)
        state.sequences[child] = SequenceState(i, detok, output)
    engine.adopt_request_state(state)
    return state


def token_logprobs(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(token_id, -1.0, 1, [token_id], [-1.0])


@dataclass
class Plan:
    """Per child: its tokens and how many of them each step brings; the finish it meets."""

    streams: dict[str, list[int]]
    step_sizes: list[int]
    finish: dict[str, str]  # "eos" | "length"


def run_steps(engine: LLMEngine, plan: Plan, tracker: OutputDeltaTracker,
              start: int = 0, stop_after_steps: int | None = None):
    """Feed the plan's tokens from token `start`; yield each step's deltas."""
    pos = dict.fromkeys(plan.streams, start)
    done: set[str] = set()
    for num_steps, size in enumerate(plan.step_sizes):
        if stop_after_steps is not None and num_steps >= stop_after_steps:
            return
        update = SchedulerUpdate()
        for child, tokens in plan.streams.items():
            if child in done or child in engine.scheduler.finished:
                continue
            new = tokens[pos[child]:pos[child] + size]
            pos[child] += len(new)
            update.new_token_ids[child] = new
            if pos[child] >= len(tokens):
                done.add(child)
                eos = plan.finish[child] == "eos"
                update.finished.append(FakeRequest(
                    child, RequestStatus.FINISHED_STOPPED if eos else RequestStatus.FINISHED_LENGTH,
                    stop_token_id=EOS if eos else None))
        if not update.new_token_ids:
            return
        result = StepResult({}, verified_logprobs={
            child: [token_logprobs(t) for t in new] for child, new in update.new_token_ids.items()})
        yield [tracker.to_delta(o) for o in engine._process(update, result, 0.0)]


class FakeClient:
    tokenizer = ByteTokenizer()
    vocab_size = EOS + 1
    max_model_len = 1024
    is_healthy = True


SERVING = OpenAIServingCompletion(FakeClient(), None, ["m"], AdmissionGate(None, lambda: 0))
STREAM_REQUEST = CompletionRequest(prompt=[0], logprobs=1, stream=True)
SENT_OFFSETS: dict[int, list[int]] = {}  # choice index -> logprobs text_offset streamed


def stream_text(choice_states, cursors, deltas) -> list[str]:
    """What the completions endpoint streams for these deltas (chunk texts per choice); the
    chunks' logprobs text offsets go to SENT_OFFSETS."""
    sent = [[] for _ in choice_states]
    state = EngineRequestState("r", [0], choice_states)
    for delta in deltas:
        for c in delta.choices:
            choice_states[c.index].apply(c)
        for choice in choice_states:
            chunk = SERVING._chunk(STREAM_REQUEST, "cmpl", state, choice, choice.index,
                                   cursors[choice.index])
            if chunk is not None:
                sent[choice.index].append(chunk.choices[0].text)
                SENT_OFFSETS.setdefault(choice.index, []).extend(
                    chunk.choices[0].logprobs.text_offset)
    return sent


def assert_offsets_as_unstreamed(choice: ChoiceState) -> None:
    """Streamed logprobs text offsets equal the non-streamed response's."""
    want = SERVING._logprobs(choice.logprobs, 0).text_offset
    assert SENT_OFFSETS.pop(choice.index, []) == want
    assert len(choice.logprobs) == len(choice.token_ids)


def expected_text(tokens: list[int], finish: str, params: SamplingParams
                  ) -> tuple[str, str | None, int]:
    """vLLM's rule, token by token: the decode of the output tokens (a final EOS's text left
    out unless include_stop_str_in_output), cut at the first stop string that completes once
    min_tokens are out (the earliest in the text; of two at one place, the first listed).
    (text, stop string, number of output tokens)."""
    tok = ByteTokenizer()
    prev = ""
    for k in range(1, len(tokens) + 1):
        ids = tokens[:k]
        last = k == len(tokens)
        if last and finish == "eos" and not params.include_stop_str_in_output:
            ids = ids[:-1]
        text = tok.decode(ids)
        if text.endswith("\ufffd") and not last:
            continue  # an incomplete character: nothing is decided on it yet
        if k >= params.min_tokens:
            hits = [(text.find(s, max(0, len(prev) - len(s) + 1)), s) for s in params.stop]
            hits = [(i, s) for i, s in hits if i != -1]
            if hits:
                i, s = min(hits, key=lambda hit: hit[0])  # earliest; ties: list order
                return (text[:i + len(s)] if params.include_stop_str_in_output
                        else text[:i]), s, k
        prev = text
    return prev, None, len(tokens)


token_streams = st.lists(st.integers(0, EOS - 1), min_size=1, max_size=14)


@st.composite
def plans(draw, n: int):
    streams, finish = {}, {}
    for i in range(n):
        child = "r" if n == 1 else f"r#{i}"
        tokens = draw(token_streams)
        finish[child] = draw(st.sampled_from(["eos", "length"]))
        if finish[child] == "eos":
            tokens = tokens + [EOS]
        streams[child] = tokens
    longest = max(len(t) for t in streams.values())
    sizes = draw(st.lists(st.integers(1, 3), min_size=longest, max_size=longest))
    return Plan(streams, sizes, finish)


@st.composite
def cases(draw, max_n: int = 3):
    n = draw(st.integers(1, max_n))
    plan = draw(plans(n))
    # Stops cut sometimes: most are drawn from the text the first sequence will produce.
    text = ByteTokenizer().decode(next(iter(plan.streams.values())))
    stop_strings_here = st.lists(st.one_of(
        st.text(st.sampled_from(STOP_ALPHABET), min_size=1, max_size=4),
        st.integers(0, max(0, len(text) - 1)).flatmap(
            lambda i: st.integers(1, 4).map(lambda k: text[i:i + k]))).filter(bool),
        max_size=3)
    params = SamplingParams(n=n, stop=draw(stop_strings_here),
                            include_stop_str_in_output=draw(st.booleans()),
                            min_tokens=draw(st.integers(0, 3)), max_tokens=64)
    # The prompt ends on whole characters (an output token that completes a prompt's partial
    # character has no text of its own to compare with).
    prompt = draw(st.lists(st.sampled_from(WHOLE), min_size=1, max_size=6))
    return params, prompt, plan


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_streamed_text_equals_final_text(case):
    params, prompt, plan = case
    SENT_OFFSETS.clear()
    engine = make_engine()
    state = add_state(engine, "r", prompt, params)
    tracker = OutputDeltaTracker()
    tracker.add_request("r", params)
    choices = [ChoiceState(i) for i in range(params.n)]
    cursors = [StreamCursor() for _ in range(params.n)]
    sent = [[] for _ in range(params.n)]
    for deltas in run_steps(engine, plan, tracker):
        for i, chunks in enumerate(stream_text(choices, cursors, deltas)):
            sent[i].extend(chunks)
    for child, seq in state.sequences.items():
        final = seq.output.text
        assert seq.output.finished
        assert "".join(sent[seq.index]) == final == choices[seq.index].text
        assert_offsets_as_unstreamed(choices[seq.index])
        want = expected_text(plan.streams[child], plan.finish[child], params)
        assert (final, seq.output.token_ids) == (want[0], plan.streams[child][:want[2]])
        if want[1] is not None:
            assert (seq.output.finish_reason, seq.output.stop_reason) == ("stop", want[1])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_n=1))
def test_disaggregated_stream_equals_final_text(case):
    """The prefill worker streams the first token's delta; the decode worker resumes after
    the characters that delta carried (`num_text_chars_sent`)."""
    params, prompt, plan = case
    SENT_OFFSETS.clear()
    tokens = plan.streams["r"]
    prefill = make_engine()
    add_state(prefill, "r", prompt, params)
    prefill_tracker = OutputDeltaTracker()
    prefill_tracker.add_request("r", params)
    first_plan = Plan(plan.streams, [1], plan.finish)
    choices, cursors = [ChoiceState(0)], [StreamCursor()]
    sent = []
    first_deltas = next(run_steps(prefill, first_plan, prefill_tracker))
    sent += stream_text(choices, cursors, first_deltas)[0]
    if not first_deltas[0].finished:
        decode = make_engine()
        state = add_state(decode, "r", prompt, params, first_token_ids={"r": tokens[0]})
        tracker = OutputDeltaTracker()
        tracker.add_request("r", params)
        tracker.resume("r", num_tokens=1, num_text_chars=len(first_deltas[0].choices[0].text),
                       num_logprobs=1)  # as decode_worker does
        for deltas in run_steps(decode, plan, tracker, start=1):
            sent += stream_text(choices, cursors, deltas)[0]
        final = state.sequences["r"].output.text
    else:
        final = choices[0].text
    assert choices[0].finish_reason is not None
    assert "".join(sent) == final == choices[0].text
    assert_offsets_as_unstreamed(choices[0])
    want = expected_text(tokens, plan.finish["r"], params)
    assert (final, choices[0].token_ids) == (want[0], tokens[:want[2]])
