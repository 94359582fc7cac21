"""IncrementalDetokenizer with the default model's real tokenizer: a sequence that
ends inside a multi-byte character keeps its last bytes (the final text is the decode of every
output token, as in vLLM), stop strings end nothing before `min_tokens`, and the text of the
stop token that ended a sequence is left out."""
from __future__ import annotations

import pytest

from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.sampling_params import SamplingParams

PROMPT = "Write something:"
TEXTS = ["Hi 😀 there", "中文 and 한국어", "ok 👍🏽 done", "naïve café — ünïcödé", "日本語のテキスト"]


@pytest.fixture(scope="module")
def tokenizer():
    from deepinfer.runtime.model_source import resolve_model
    return resolve_model(None).load_tokenizer()


def feed(tokenizer, ids: list[int], final: bool = True, **params) -> tuple[str, str | None]:
    """Feed `ids` one token at a time, the last one marked final; (text, stop string)."""
    detok = IncrementalDetokenizer.for_request(
        tokenizer, tokenizer.encode(PROMPT, add_special_tokens=False), SamplingParams(**params))
    stop = None
    for i, token in enumerate(ids):
        stop = detok.add_tokens([token], final=final and i == len(ids) - 1)
        if stop is not None:
            break
    return detok.text, stop


def test_precondition_the_texts_split_characters_across_tokens(tokenizer):
    split = [t for t in TEXTS if any("\ufffd" in tokenizer.decode([i])
                                     for i in tokenizer.encode(t, add_special_tokens=False))]
    assert len(split) >= 4, "the test texts no longer split a character across tokens"


@pytest.mark.parametrize("text", TEXTS)
def test_final_text_is_the_decode_of_every_output_token(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut_mid_char = 0
    for k in range(1, len(ids) + 1):
        want = tokenizer.decode(ids[:k])
        got, stop = feed(tokenizer, ids[:k])
        assert stop is None
        assert got == want, f"ended after {k} tokens: {got!r} != {want!r}"
        cut_mid_char += want.endswith("\ufffd")
    if any("\ufffd" in tokenizer.decode([i]) for i in ids):
        assert cut_mid_char >= 1


def test_emoji_split_after_one_token(tokenizer):
    """The bench-serve symptom: a one-token completion that is the first byte(s) of an emoji
    came back as empty text."""
    first = tokenizer.encode("😀", add_special_tokens=False)[:1]
    text, _ = feed(tokenizer, first)
    assert text == tokenizer.decode(first) and text != ""
    # Not final: the incomplete character is still held back while streaming.
    held, _ = feed(tokenizer, first, final=False)
    assert held == ""


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    assert len(ids) == 5, ids  # one token per word: " two" is complete after token 2
    text, stop = feed(tokenizer, ids, stop=[" two"])
    assert (text, stop) == ("one", " two")
    text, stop = feed(tokenizer, ids, stop=[" two"], min_tokens=2)
    assert (text, stop) == ("one", " two")
    # Before min_tokens the stop string does not end the sequence (vLLM's rule) ...
    text, stop = feed(tokenizer, ids, stop=[" two"], min_tokens=3, max_tokens=5)
    assert (text, stop) == ("one two three four five", None)
    # ... but a stop string completed at or after min_tokens does.
    text, stop = feed(tokenizer, ids, stop=[" two", " four"], min_tokens=3, max_tokens=5)
    assert (text, stop) == ("one two three", " four")


def test_stop_token_text_is_left_out(tokenizer):
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    for include, want in ((False, tokenizer.decode(ids[:-1])), (True, tokenizer.decode(ids))):
        detok = IncrementalDetokenizer.for_request(
            tokenizer, prompt, SamplingParams(include_stop_str_in_output=include))
        detok.add_tokens(ids[:-1])
        detok.add_tokens(ids[-1:], final=True, stop_token=True)
        assert detok.text == want


def test_direct_window_decode_equals_tokenizer_decode(tokenizer):
    """The detokenizer decodes windows with the backend tokenizer directly: the text
    must equal the tokenizer's own decode, special tokens and split characters included."""
    import random

    from deepinfer.engine.detokenizer import window_decoder
    decode = window_decoder(tokenizer)
    assert decode.__code__ is not window_decoder(object()).__code__  # the direct path is taken here
    rng = random.Random(0)
    ids = [i for t in TEXTS for i in tokenizer.encode(t, add_special_tokens=False)]
    special = list(tokenizer.all_special_ids)
    windows = [ids[i:i + n] for i in range(len(ids)) for n in (1, 2, 3, 7)]
    windows += [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 9))] + [s]
                for s in special for _ in range(5)]
    for window in windows:
        for skip in (True, False):
            assert decode(window, skip) == tokenizer.decode(window, skip_special_tokens=skip), window


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_with_direct_decode_equals_plain_decode(tokenizer, text, monkeypatch):
    import deepinfer.engine.detokenizer as detok_module
    ids = tokenizer.encode(text + " the end", add_special_tokens=False) + [tokenizer.eos_token_id]
    fast = feed(tokenizer, ids, skip_special_tokens=False)
    monkeypatch.setattr(detok_module, "window_decoder", lambda tok: (
        lambda w, skip_special_tokens: tok.decode(w, skip_special_tokens=skip_special_tokens)))
    assert feed(tokenizer, ids, skip_special_tokens=False) == fast


@pytest.mark.parametrize("skip", [True, False])
def test_mixed_special_and_split_tokens_in_steps_of_any_size(tokenizer, skip):
    """Output mixing special tokens and characters split across tokens, fed one token at a
    time or several per step (as speculative decoding emits them): the final text is the
    tokenizer's decode of the output, with special tokens skipped or not."""
    import random
    rng = random.Random(1)
    pool = [i for t in TEXTS for i in tokenizer.encode(t, add_special_tokens=False)]
    special = list(tokenizer.all_special_ids)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.2 else rng.choice(pool)
               for _ in range(rng.randint(1, 12))]
        detok = IncrementalDetokenizer.for_request(
            tokenizer, prompt, SamplingParams(skip_special_tokens=skip))
        pos = 0
        while pos < len(ids):
            step = rng.randint(1, 4)
            chunk = ids[pos:pos + step]
            pos += len(chunk)
            detok.add_tokens(chunk, final=pos == len(ids))
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip), ids
