"""Chat prefix completion and fill-in-the-middle prompts with the default model's real
tokenizer (no engine): the prompt of a final assistant message with `"prefix": true` (or
continue_final_message) is exactly transformers' apply_chat_template(...,
continue_final_message=True); FIM prompts for each family's tokens equal the tokenization of
the family's FIM string, and a tokenizer without FIM tokens is a 400 naming `suffix`."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepinfer.server.admission import AdmissionGate
from deepinfer.server.errors import APIError
from deepinfer.server.fim import FIM_FAMILIES
from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.server.serving_chat import OpenAIServingChat
from deepinfer.server.serving_completion import OpenAIServingCompletion


@pytest.fixture(scope="module")
def tokenizer(default_model_source):
    return default_model_source.load_tokenizer()


def serving(cls, tokenizer):
    client = SimpleNamespace(vocab_size=len(tokenizer), max_model_len=2048, tokenizer=tokenizer,
                             is_healthy=True, dead_message=None)
    return cls(client, None, ["m"], AdmissionGate(None, lambda: 0))


CHAT = [{"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into"}]


@pytest.mark.parametrize("fields", [
    {"messages": CHAT[:1] + [{**CHAT[1], "prefix": True}]},
    {"messages": CHAT, "continue_final_message": True},
])
def test_prefix_continues_the_assistant_message(tokenizer, fields):
    chat = serving(OpenAIServingChat, tokenizer)
    prompt, _, admission = chat._prepare(ChatCompletionRequest(**fields))
    admission.release()
    want = tokenizer.apply_chat_template(CHAT, continue_final_message=True, tokenize=False)
    assert want.endswith("Waves fold into")
    assert prompt == tokenizer.encode(want, add_special_tokens=False)
    plain, _, admission = chat._prepare(ChatCompletionRequest(messages=CHAT))
    admission.release()
    assert plain != prompt  # without prefix: the turn is closed and a new one opened


@pytest.mark.parametrize("fields,param", [
    ({"messages": [{**CHAT[0], "prefix": True}, CHAT[1]]}, "messages[0].prefix"),
    ({"messages": CHAT[:1], "continue_final_message": True}, "continue_final_message"),
    ({"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
     "add_generation_prompt"),
    ({"messages": CHAT[:1] + [{**CHAT[1], "prefix": "yes"}]}, "messages[1].prefix"),
])
def test_bad_prefix_requests(tokenizer, fields, param):
    with pytest.raises(APIError) as info:
        serving(OpenAIServingChat, tokenizer)._prepare(ChatCompletionRequest(**fields))
    assert info.value.info.param == param


def test_suffix_without_fim_tokens_is_a_400(tokenizer):
    completion = serving(OpenAIServingCompletion, tokenizer)
    with pytest.raises(APIError) as info:
        completion._prepare(CompletionRequest(prompt="def f(", suffix="\n    return x"))
    assert info.value.status_code == 400 and info.value.info.param == "suffix"
    assert "FIM" in info.value.info.message


@pytest.mark.parametrize("family", FIM_FAMILIES, ids=[f.family for f in FIM_FAMILIES])
def test_fim_prompt_of_each_family(default_model_source, family):
    tokenizer = default_model_source.load_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        family.prefix, family.suffix, family.middle]})
    completion = serving(OpenAIServingCompletion, tokenizer)
    prefix, suffix = "def mean(xs):\n    total = ", "\n    return total / len(xs)\n"
    prompts, _, admission = completion._prepare(CompletionRequest(
        prompt=[prefix, "x = "], suffix=suffix, max_tokens=8))
    admission.release()
    want = tokenizer.encode(family.prefix + prefix + family.suffix + suffix + family.middle)
    assert prompts[0] == want
    vocab = tokenizer.get_vocab()
    assert prompts[1][-1] == vocab[family.middle] and vocab[family.prefix] in prompts[1]
    with pytest.raises(APIError):  # token prompts cannot be split around a suffix
        completion._prepare(CompletionRequest(prompt=[1, 2, 3], suffix=suffix))
