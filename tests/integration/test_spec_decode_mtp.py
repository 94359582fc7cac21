"""MTP speculative decoding on a tiny DeepSeek-V3 whose checkpoint carries a multi-token-
prediction layer (written as DeepSeek's releases store it: `model.layers.{N}.*`). Greedy
outputs with k = 1..6 equal the engine without speculation, in a batch with a 130-token
prompt, under preemption and on prefix-cache hits; the "echo" MTP layer (it predicts the
token the target just predicted) gets drafts accepted wherever the target repeats itself,
the random one almost never. Also: the MTP weights load from the checkpoint, a model without
them is a clear error, streaming returns every accepted token of a step.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from tests.integration.engine_checks import generate_checked, token_prompts
from tests.integration.moe_checkpoints import add_mtp_layer, random_prompts, tiny_moe_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory, default_model_source):
    """{"echo": dir, "random": dir, "plain": dir (no MTP layer)} of one tiny DeepSeek-V3."""
    tokenizer = default_model_source.load_tokenizer()
    model = tiny_moe_model("deepseek_v3", seed=20)
    out = {}
    for kind in ("echo", "random", "plain"):
        directory = tmp_path_factory.mktemp(f"mtp_{kind}")
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        if kind != "plain":
            add_mtp_layer(directory, seed=3, echo=kind == "echo")
        out[kind] = str(directory)
    return out


def make_llm(directory: str, **kwargs):
    from deepinfer import LLM
    kwargs.setdefault("kv_cache_memory", "64MiB")
    return LLM(model=directory, dtype="float32", seed=0, block_size=16, **kwargs)


def prompts() -> list[dict]:
    shared = random_prompts(seed=9, lengths=(40,))[0]
    distinct = random_prompts(seed=5, lengths=(3, 17, 130))
    return token_prompts(distinct + [shared + [7, 8], shared + [9]])


@pytest.fixture(scope="module")
def baseline(mtp_dirs):
    return generate_checked(make_llm(mtp_dirs["echo"]), prompts(), GREEDY)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_mtp_greedy_equals_no_speculation(mtp_dirs, baseline, k):
    llm = make_llm(mtp_dirs["echo"], speculative_config={"method": "mtp",
                                                         "num_speculative_tokens": k})
    outputs = generate_checked(llm, prompts(), GREEDY)
    assert tokens(outputs) == tokens(baseline)
    for got, want in zip(outputs, baseline):
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    again = generate_checked(llm, prompts()[3:], GREEDY)  # prefix-cache hits
    assert all(o.num_cached_tokens > 0 for o in again)
    assert tokens(again) == tokens(baseline[3:])


def test_mtp_random_layer_and_preemption(mtp_dirs, baseline):
    llm = make_llm(mtp_dirs["random"], num_kv_blocks=12,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    outputs = generate_checked(llm, prompts(), GREEDY)
    assert tokens(outputs) == tokens(baseline)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_drafts > 0


def test_mtp_weights_load_from_the_checkpoint(mtp_dirs):
    from safetensors import safe_open

    llm = make_llm(mtp_dirs["random"], speculative_config={"method": "mtp"})
    mtp = llm.engine.speculator.drafter.runner.model.layers[0]
    with safe_open(f"{mtp_dirs['random']}/model.safetensors", "pt") as f:
        assert torch.equal(mtp.eh_proj.weight, f.get_tensor("model.layers.3.eh_proj.weight"))
        assert torch.equal(mtp.shared_head.head.weight,
                           f.get_tensor("model.layers.3.shared_head.head.weight"))
        gate = f.get_tensor("model.layers.3.mlp.experts.5.gate_proj.weight")
        assert torch.equal(mtp.mlp.experts.gate_up_proj[5, :gate.shape[0]], gate)


def test_mtp_needs_mtp_layers(mtp_dirs):
    with pytest.raises(ValueError, match="multi-token-prediction layers"):
        make_llm(mtp_dirs["plain"], speculative_config={"method": "mtp"})


def test_seeded_mtp_sampling_is_reproducible_and_streams_every_accepted_token(mtp_dirs, baseline):
    llm = make_llm(mtp_dirs["echo"], speculative_config={"method": "mtp",
                                                         "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = prompts()[2]
    alone = tokens(generate_checked(llm, [prompt], params))[0]
    batched = tokens(generate_checked(llm, prompts(), params))[2]
    assert batched == alone
    engine = llm.engine
    for i, p in enumerate(prompts()):
        engine.add_request(f"stream{i}", p["prompt_token_ids"], GREEDY)
    seen: dict[str, list[int]] = {}
    steps_with_several = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed = seen.setdefault(out.request_id, [])
            new = out.outputs[0].token_ids[len(streamed):]
            steps_with_several += len(new) > 1
            streamed.extend(new)
    assert [seen[f"stream{i}"] for i in range(len(baseline))] == tokens(baseline)
    assert steps_with_several > 0
