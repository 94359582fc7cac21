"""Penalties, logit_bias and allowed_token_ids on the real model (fp32): greedy output equals a
plain-torch reference (transformers logits over the engine's own tokens, processed by the
definitions), and speculative decoding (n-gram, several tokens accepted per step) gives the
same tokens, greedy and seeded, as decoding without it."""
from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from tests.integration.engine_checks import generate_checked

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["Repeat after me: red, green, blue, red, green, blue, red, green,",
           "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return"]
MAX_TOKENS = 10
PENALISED = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                 presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3,
                 logit_bias={11: 2.5})  # 11 is ","
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def processed(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
              output: list[int]) -> torch.Tensor:
    """The definitions, one position: bias, repetition over prompt and output, then frequency
    and presence over the output."""
    out = logits.clone()
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    seen = torch.tensor(sorted(set(prompt) | set(output)))
    penalty = params.repetition_penalty
    out[seen] = torch.where(out[seen] > 0, out[seen] / penalty, out[seen] * penalty)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=out.shape[0])
    out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return out


@pytest.fixture(scope="module")
def penalised_outputs(engine_base_llm):
    params = SamplingParams(**PENALISED)
    return params, generate_checked(engine_base_llm, PROMPTS, params)


def test_penalised_greedy_matches_the_torch_reference(engine_base_llm, hf_reference,
                                                      penalised_outputs):
    params, outputs = penalised_outputs
    num_moved = num_checked = 0  # moved: positions where the processing changed the token
    for out in outputs:
        prompt, tokens = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        ids = torch.tensor([prompt + tokens])
        with torch.inference_mode():
            hidden = hf_reference.model.model(input_ids=ids, use_cache=False).last_hidden_state
            logits = hf_reference.model.lm_head(hidden[0, len(prompt) - 1:-1]).float()
        for i, token in enumerate(tokens):
            want = processed(logits[i], params, prompt, tokens[:i])
            top2 = want.topk(2)
            if float(top2.values[0] - top2.values[1]) < 1e-3:
                break  # a near-tie: the fp32 kernels may order it either way from here
            assert token == int(top2.indices[0]), f"position {i}: {token} vs {top2.indices[0]}"
            num_moved += token != int(logits[i].argmax())
            num_checked += 1
    assert num_moved > 0, "the penalties changed nothing"
    assert num_checked >= len(outputs) * MAX_TOKENS // 2, "near-ties cut the check short"


# Mild enough that the repeats n-gram drafts bet on still happen (drafts get accepted), strong
# enough to move logits: a penalty counted once per step instead of per position would differ.
MILD = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=0.3,
            repetition_penalty=1.05, logit_bias={11: 0.5}, bad_words=["blue"])


def test_speculation_gives_the_same_tokens(make_engine_llm, engine_base_llm):
    cases = [("greedy", PROMPTS, SamplingParams(**MILD)),
             ("seeded n=2", PROMPTS[:1], SamplingParams(**{**MILD, "temperature": 0.8,
                                                            "seed": 7, "n": 2})),
             ("allowed", PROMPTS[:1], SamplingParams(
                 temperature=0.0, max_tokens=6, ignore_eos=True, min_tokens=2,
                 allowed_token_ids=[11, 198, 253, 2380, 3380], stop_token_ids=[198]))]
    want = [generate_checked(engine_base_llm, prompts, p) for _, prompts, p in cases]
    spec = make_engine_llm(speculative_config=NGRAM)
    for (label, prompts, p), w in zip(cases, want):
        got = generate_checked(spec, prompts, p)
        for g, ref in zip(got, w):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in ref.outputs], label
            assert [c.text for c in g.outputs] == [c.text for c in ref.outputs], label
        if label == "greedy":  # several tokens per step happened
            assert spec.engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert set(want[2][0].outputs[0].token_ids) <= {11, 198, 253, 2380, 3380}
    assert "blue" not in want[0][0].outputs[0].text  # the prompt's pattern says blue next


def test_allowed_ids_that_min_tokens_masks_are_refused(engine_base_llm):
    """Every allowed id masked before min_tokens would sample an arbitrary token."""
    eos = engine_base_llm.engine.eos_token_ids[0]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        engine_base_llm.generate(["Hi"], SamplingParams(allowed_token_ids=[eos], min_tokens=1,
                                                        max_tokens=4))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        engine_base_llm.generate(["Hi"], SamplingParams(allowed_token_ids=[5], min_tokens=1,
                                                        stop_token_ids=[5], max_tokens=4))
