"""Sampling with speculation follows the target's distribution.

A tiny random Llama (attention dampened, so the last token matters most) is the target; the
drafter is the same model with a perturbed LM head,
so its q overlaps p without equalling it (drafts are accepted and rejected). With top_k=3 the
first three output tokens have 27 possible sequences; their exact probabilities under the
target come from transformers. 1500 seeded requests (fixed seeds: deterministic) are sampled
with speculation, and a chi-square test compares the sequence counts with the target's
probabilities; the same test rejects the drafter's own distribution (it has power). Both
verification paths are covered: draft_model (drafts sampled from q: rejection sampling) and
ngram (one-hot q).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer import SamplingParams
from tests.chi_square import chi_square_pvalue
from tests.integration.engine_checks import generate_checked, token_prompts
from tests.integration.tiny_models import hf_logits, tiny_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

START = [17, 93, 5]
TOP_K = 3
NUM_SEEDS = 1500


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_source):
    target = tiny_hf_model("llama", seed=1)
    drafter = tiny_hf_model("llama", seed=1)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        # Attention outputs dampened: the next token depends mostly on the last one, so the
        # n-gram drafter's proposals (what followed that token before) are often right.
        for model in (target, drafter):
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.1)
        head = drafter.lm_head.weight
        head.add_(0.6 * head.std() * torch.randn(head.shape, generator=gen))
    # START, its greedy continuation, START again: the n-gram drafter then proposes that
    # continuation whenever the sample follows it.
    prompt = list(START)
    for _ in range(4):
        prompt.append(int(hf_logits(target, prompt)[-1].argmax()))
    prompt += START
    dirs = {}
    for name, model in (("target", target), ("drafter", drafter)):
        directory = tmp_path_factory.mktemp(f"stats_{name}")
        model.save_pretrained(directory)
        default_model_source.load_tokenizer().save_pretrained(directory)
        dirs[name] = str(directory)
    return target, drafter, dirs, prompt


def top_k_probs(model, tokens: list[int]) -> torch.Tensor:
    logits = hf_logits(model, tokens)[-1]
    kth = logits.topk(TOP_K).values[-1]
    return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)


def joint(prompt, first, later) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3): t1 from `first`'s distribution, t2 and t3 from `later`'s."""
    out = {}
    p1 = top_k_probs(first, prompt)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = top_k_probs(later, prompt + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            p3 = top_k_probs(later, prompt + [t1, t2])
            for t3 in p3.nonzero().flatten().tolist():
                out[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return out


def sample_sequences(directory: str, prompt: list[int], config: dict) -> tuple[dict, object]:
    from deepinfer import LLM

    llm = LLM(model=directory, dtype="float32", seed=0, kv_cache_memory="64MiB",
              speculative_config=config)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=s, max_tokens=3,
                             ignore_eos=True) for s in range(NUM_SEEDS)]
    outputs = generate_checked(llm, token_prompts([prompt] * NUM_SEEDS), params)
    counts: dict[tuple[int, ...], int] = {}
    for o in outputs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts, llm.engine.get_stats()


def pvalue(counts: dict, probs: dict) -> float:
    assert set(counts) <= set(probs), "a sequence outside the target's top-k support"
    keys = sorted(probs)
    return chi_square_pvalue([counts.get(k, 0) for k in keys], [probs[k] for k in keys])


@pytest.mark.parametrize("config", [
    {"method": "draft_model", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
     "prompt_lookup_max": 2}])
def test_speculative_sampling_matches_the_target_distribution(models, config):
    target, drafter, dirs, prompt = models
    if config["method"] == "draft_model":
        config = dict(config, model=dirs["drafter"])
    expected = joint(prompt, target, target)
    counts, stats = sample_sequences(dirs["target"], prompt, config)
    assert sum(counts.values()) == NUM_SEEDS
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert pvalue(counts, expected) > 1e-3
    # Power: tokens drawn from the drafter's q instead would be rejected by the same test.
    wrong = joint(prompt, target, drafter)
    as_if_drafted = {k: round(NUM_SEEDS * v) for k, v in wrong.items() if k in expected}
    assert pvalue(as_if_drafted, expected) < 1e-6
