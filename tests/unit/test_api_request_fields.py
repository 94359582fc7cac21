"""Every request option either changes what the engine is asked for, or is a 400 that names
it: none is dropped without a word (vLLM extras included). Runs the endpoints' request
preparation on a stub engine client (no model, no process)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from deepinfer.server.admission import AdmissionGate
from deepinfer.server.errors import APIError
from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.server.serving_chat import OpenAIServingChat
from deepinfer.server.serving_completion import OpenAIServingCompletion

VOCAB = 100
BOS = 1


class StubTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [10 + (ord(c) % 80) for c in text]
        return [BOS] + ids if add_special_tokens else ids

    def decode(self, ids) -> str:
        return "".join(chr(32 + t % 90) for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ">"


def make(cls):
    client = SimpleNamespace(vocab_size=VOCAB, max_model_len=64, tokenizer=StubTokenizer(),
                             is_healthy=True, dead_message=None, supports_prompt_logprobs=True)
    return cls(client, None, ["m"], AdmissionGate(None, lambda: 0))


@pytest.fixture(scope="module")
def completion():
    return make(OpenAIServingCompletion)


@pytest.fixture(scope="module")
def chat():
    return make(OpenAIServingChat)


def prepare_completion(serving, **fields):
    prompts, params, admission = serving._prepare(CompletionRequest(prompt="hello", **fields))
    admission.release()
    return prompts[0], params[0]


def prepare_chat(serving, **fields):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hello"}], **fields)
    prompt, params, admission = serving._prepare(request)
    admission.release()
    return prompt, params


def error(fn, *args, **fields) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **fields)
    assert e.value.status_code == 400
    return e.value


# --- implemented options reach the engine's SamplingParams ---------------------------------

IMPLEMENTED = [
    (dict(presence_penalty=0.5), "presence_penalty", 0.5),
    (dict(frequency_penalty=-1.25), "frequency_penalty", -1.25),
    (dict(repetition_penalty=1.3), "repetition_penalty", 1.3),
    (dict(logit_bias={"5": 3.0, "7": -100}), "logit_bias", {5: 3.0, 7: -100.0}),
    (dict(allowed_token_ids=[3, 4, 5]), "allowed_token_ids", [3, 4, 5]),
    (dict(bad_words=["red", "blue sky"]), "bad_words", ["red", "blue sky"]),
    (dict(top_k=5), "top_k", 5), (dict(min_p=0.2), "min_p", 0.2),
    (dict(min_tokens=3), "min_tokens", 3), (dict(stop_token_ids=[9]), "stop_token_ids", [9]),
    (dict(seed=11), "seed", 11), (dict(n=3), "n", 3),
    (dict(skip_special_tokens=False), "skip_special_tokens", False),
    (dict(include_stop_str_in_output=True), "include_stop_str_in_output", True),
    (dict(ignore_eos=True), "ignore_eos", True), (dict(stop=["x"]), "stop", ["x"]),
]


@pytest.mark.parametrize("fields,name,value", IMPLEMENTED, ids=[c[1] for c in IMPLEMENTED])
def test_options_reach_the_sampling_params(completion, chat, fields, name, value):
    assert getattr(prepare_completion(completion, **fields)[1], name) == value
    assert getattr(prepare_chat(chat, **fields)[1], name) == value


def test_max_tokens_and_logprobs_per_endpoint(completion, chat):
    assert prepare_completion(completion, max_tokens=7, logprobs=3)[1].logprobs == 3
    _, params = prepare_chat(chat, max_completion_tokens=5, max_tokens=9, logprobs=True,
                             top_logprobs=4)
    assert params.max_tokens == 5 and params.logprobs == 4


def test_truncate_prompt_tokens_keeps_the_last_tokens(completion, chat):
    full, _ = prepare_completion(completion)
    assert prepare_completion(completion, truncate_prompt_tokens=3)[0] == full[-3:]
    assert prepare_completion(completion, truncate_prompt_tokens=-1)[0] == full
    full_chat, _ = prepare_chat(chat)
    assert prepare_chat(chat, truncate_prompt_tokens=4)[0] == full_chat[-4:]
    assert error(prepare_completion, completion, truncate_prompt_tokens=0).info.param == \
        "truncate_prompt_tokens"


def test_add_special_tokens_for_completions(completion):
    assert prepare_completion(completion)[0][0] == BOS
    assert prepare_completion(completion, add_special_tokens=False)[0][0] != BOS


# --- bad values of implemented options: a 400 naming the field -------------------------------

BAD_VALUES = [
    (dict(logit_bias={"abc": 1.0}), "logit_bias"), (dict(logit_bias={"500": 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 200.0}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[VOCAB]), "allowed_token_ids"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(bad_words=[" "]), "bad_words"),
]


@pytest.mark.parametrize("fields,param", BAD_VALUES, ids=[c[1] for c in BAD_VALUES])
def test_bad_values_name_the_field(completion, fields, param):
    from pydantic import ValidationError
    try:
        e = error(prepare_completion, completion, **fields)
    except ValidationError as v:  # pydantic range checks: the app turns these into 400s
        assert v.errors()[0]["loc"][0] == param
        return
    assert e.info.param == param, e.info.message


# --- options we do not implement: a 400 naming them, unless sent "off" ----------------------

UNSUPPORTED_BOTH = [
    ("use_beam_search", True),
    ("length_penalty", 0.5), ("spaces_between_special_tokens", False),
    ("guided_whitespace_pattern", " *"), ("guided_decoding_backend", "outlines"),
    ("logits_processors", ["x"]), ("priority", 5),
]
UNSUPPORTED_CHAT = [
    ("functions", [{"name": "f"}]), ("chat_template", "{{ x }}"),
    ("echo", True), ("add_special_tokens", True), ("modalities", ["text", "audio"]),
    ("audio", {"voice": "x"}), ("prompt_logprobs", 1),
]
UNSUPPORTED_COMPLETION = [("best_of", 3)]


@pytest.mark.parametrize("name,value", UNSUPPORTED_BOTH + UNSUPPORTED_CHAT,
                         ids=[c[0] for c in UNSUPPORTED_BOTH + UNSUPPORTED_CHAT])
def test_chat_rejects_unsupported_options(chat, name, value):
    e = error(prepare_chat, chat, **{name: value})
    assert e.info.param == name and name in e.info.message


@pytest.mark.parametrize("name,value", UNSUPPORTED_BOTH + UNSUPPORTED_COMPLETION,
                         ids=[c[0] for c in UNSUPPORTED_BOTH + UNSUPPORTED_COMPLETION])
def test_completion_rejects_unsupported_options(completion, name, value):
    e = error(prepare_completion, completion, **{name: value})
    assert e.info.param == name and name in e.info.message


OFF_VALUES = [("use_beam_search", False), ("length_penalty", 1), ("length_penalty", 1.0),
              ("spaces_between_special_tokens", True), ("priority", 0),
              ("prompt_logprobs", None), ("guided_json", None), ("tool_choice", "none"),
              ("modalities", ["text"]), ("response_format", {"type": "text"})]


@pytest.mark.parametrize("name,value", OFF_VALUES, ids=[f"{n}={v}" for n, v in OFF_VALUES])
def test_off_values_are_accepted(chat, name, value):
    prepare_chat(chat, **{name: value})


def test_booleans_are_not_numbers(chat):
    """priority: false is not the number 0, nor length_penalty: true the number 1."""
    assert error(prepare_chat, chat, length_penalty=True).info.param == "length_penalty"
    assert error(prepare_chat, chat, priority=False).info.param == "priority"


def test_stream_options(completion, chat):
    e = error(prepare_chat, chat, stream_options={"include_usage": True})
    assert e.info.param == "stream_options"
    prepare_chat(chat, stream=True, stream_options={"include_usage": True})
    e = error(prepare_completion, completion, stream=True,
              stream_options={"continuous_usage_stats": True})
    assert e.info.param == "stream_options"


def test_unknown_fields_are_accepted_and_logged_once(chat, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.server.serving_base"):
        for _ in range(3):
            prepare_chat(chat, some_future_openai_option_xyz=1, another_extra_abc="a")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("some_future_openai_option_xyz" in m for m in messages) == 1
    assert sum("another_extra_abc" in m for m in messages) == 1


def test_engine_rejections_name_the_field(chat):
    """The engine checks some values against the model (EOS, tokenized bad words): its
    rejection carries the field (RequestError.param) and becomes a 400 naming that field,
    not the prompt, however the message is worded."""
    import asyncio

    from deepinfer.wire.engine_messages import RequestError, rejection_error

    async def generate(*args, **kwargs):
        raise rejection_error(RequestError("r", "no token is left to sample before min_tokens",
                                           param="allowed_token_ids"))
        yield  # an async generator, like the real client's

    serving = make(OpenAIServingChat)
    serving.client.generate = generate
    prompt, params, admission = serving._prepare(ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], allowed_token_ids=[2], min_tokens=1))
    timer = SimpleNamespace(on_finish=lambda *a: None, on_failure=lambda *a: None)
    serving.metrics = SimpleNamespace(request_timer=lambda arrival: timer)

    async def run():
        async for _ in serving.submit("r", prompt, params, admission):
            pass

    with pytest.raises(APIError) as e:
        asyncio.run(run())
    assert e.value.status_code == 400 and e.value.info.param == "allowed_token_ids"


# --- the 400's param comes from the field the check names, never from the message ------------

SAMPLING_ERRORS = [
    (dict(n=0), "n"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(bad_words=[" "]), "bad_words"),
]


@pytest.mark.parametrize("fields,param", SAMPLING_ERRORS,
                         ids=[f"{p}-{i}" for i, (_, p) in enumerate(SAMPLING_ERRORS)])
def test_every_sampling_params_error_names_its_field(fields, param):
    from deepinfer.invalid_parameter import InvalidParameter
    from deepinfer.sampling_params import SamplingParams
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**fields)
    assert e.value.param == param
    assert isinstance(e.value, ValueError)  # callers that catch ValueError still do


class _Reworded:
    """SamplingParams whose check fails with a message that starts with no field name."""

    def __init__(self, param):
        self.param = param

    def __call__(self, **kwargs):
        from deepinfer.invalid_parameter import InvalidParameter
        raise InvalidParameter(self.param, "a value out of range (reworded)")


@pytest.mark.parametrize("param", ["presence_penalty", "min_tokens", "stop", "logit_bias"])
def test_param_does_not_depend_on_the_message(completion, monkeypatch, param):
    import deepinfer.server.serving_base as serving_base
    monkeypatch.setattr(serving_base, "SamplingParams", _Reworded(param))
    assert error(prepare_completion, completion).info.param == param


def test_chat_names_its_own_field_for_logprobs(chat, monkeypatch):
    """SamplingParams.logprobs is chat's top_logprobs (chat's `logprobs` is a boolean)."""
    import deepinfer.server.serving_base as serving_base
    monkeypatch.setattr(serving_base, "SamplingParams", _Reworded("logprobs"))
    assert error(prepare_chat, chat, logprobs=True, top_logprobs=2).info.param == "top_logprobs"


def test_engine_loop_sends_the_rejected_field():
    """The engine process's rejection carries InvalidParameter.param over the wire."""
    from deepinfer.invalid_parameter import InvalidParameter
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.cluster.engine_proc import EngineLoop
    from deepinfer.wire.engine_messages import (AddRequest, EngineOutputs, make_encoder,
                                           make_engine_decoder, rejection_error)

    class Engine:
        def add_request(self, *args, **kwargs):
            raise InvalidParameter("stop_token_ids", "an id outside the vocabulary")

    loop = EngineLoop(Engine(), None, None)
    loop._handle(AddRequest("r", [1, 2], SamplingParams(), 0.0))
    frame = make_encoder().encode(EngineOutputs([], loop._pending_errors))
    error = make_engine_decoder().decode(frame).errors[0]
    raised = rejection_error(error)
    assert isinstance(raised, InvalidParameter) and raised.param == "stop_token_ids"
    assert str(raised) == "an id outside the vocabulary"


def test_excluded_tokens_logprobs_are_valid_json(completion, chat):
    """A token the request's processing excluded has log-prob -inf (--logprobs-mode
    processed_*, e.g. top_k or allowed_token_ids): sent as vLLM's floor -9999.0, since JSON has
    no -inf (the non-streamed response was a 500)."""
    import json

    from deepinfer.core.scheduler_output import TokenLogprobs
    lps = [TokenLogprobs(token_id=5, logprob=-0.0, rank=1, top_token_ids=[5, 6, 7],
                         top_logprobs=[0.0, float("-inf"), float("-inf")])]
    for body in (completion._logprobs(lps, 0).model_dump(), chat._logprobs(lps).model_dump()):
        text = json.dumps(body, allow_nan=False)  # as the JSON response encodes it
        assert "-9999.0" in text


def test_engine_context_check_names_max_tokens():
    """The engine's own prompt + max_tokens check (a worker whose context is shorter than the
    front's) names max_tokens, not the prompt."""
    from deepinfer.engine.request_checks import resolve_max_tokens
    from deepinfer.invalid_parameter import InvalidParameter
    from deepinfer.sampling_params import SamplingParams
    with pytest.raises(InvalidParameter) as e:
        resolve_max_tokens(SamplingParams(max_tokens=8), 5, max_model_len=10)
    assert e.value.param == "max_tokens" and "maximum context length of 10" in str(e.value)
