"""Tiny FP8 DeepSeek-V3 checkpoints (release layout) served by real worker processes: one
prefill and one decode worker give transformers' greedy tokens on the dequantized copy, and a
request's prompt log-probs (computed by the prefill worker) reach the front with the first
token, equal to transformers' log-softmax over the prompt; an expert-parallel group of two
ranks equals one FP8 engine while EPLB moves FP8 experts between the ranks."""
from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from tests.integration.fp8_checkpoints import fp8_hf_model, write_fp8_pair
from tests.integration.hf_reference import assert_matches_reference
from tests.integration.moe_checkpoints import random_prompts
from tests.integration.test_moe_engine_reference import TinyReference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory, default_model_source):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fp8_serve")
    write_fp8_pair(fp8_hf_model("deepseek_v3", seed=51), str(root / "fp8"), str(root / "ref"),
                   default_model_source.load_tokenizer())
    reference = AutoModelForCausalLM.from_pretrained(str(root / "ref"), dtype=torch.float32)
    return str(root / "fp8"), TinyReference(reference.eval())


async def _prompt_logprobs(client, request_id: str, prompt: list[int], params) -> tuple:
    tokens, prompt_logprobs = [], None
    async for delta in client.generate(request_id, prompt, params):
        tokens += delta.choices[0].token_ids
        if delta.prompt_logprobs is not None:
            assert prompt_logprobs is None, "prompt log-probs sent twice"
            prompt_logprobs = delta.prompt_logprobs
    return tokens, prompt_logprobs


def test_fp8_deepseek_prefill_decode_workers_match_transformers(fp8_deepseek, tmp_path):
    from deepinfer.cluster.cluster_config import ClusterConfig
    from deepinfer.engine.engine_config import EngineConfig
    from tests.integration.disagg_harness import ClusterHarness

    directory, reference = fp8_deepseek
    prompts = random_prompts(seed=15, lengths=(9, 40, 120))
    harness = ClusterHarness(
        ClusterConfig(num_prefill_workers=1, num_decode_workers=1, kv_store_url=f"fs://{tmp_path}",
                      heartbeat_timeout_s=10.0, transfer_timeout_s=15.0, stall_timeout_s=60.0),
        EngineConfig(model=directory, dtype="float32", num_kv_blocks=128, num_threads=1, seed=0))
    try:
        results = harness.generate_many({f"fp8-{i}": p for i, p in enumerate(prompts)}, GREEDY)
        for i, prompt in enumerate(prompts):
            got = results[f"fp8-{i}"]
            assert got["error"] is None and len(got["tokens"]) == GREEDY.max_tokens, got
            ref = reference.score(prompt, got["tokens"])
            assert_matches_reference(ref, f"P1/D1 prompt {i}")
            assert ref.num_checked_tokens >= 8
        assert harness.counters("decode-0").transfer_bytes > 0

        prompt = prompts[1]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
        tokens, got = harness.run(_prompt_logprobs(harness.client, "fp8-plp", prompt, params))
        assert tokens == results["fp8-1"]["tokens"][:4]
        with torch.no_grad():
            logits = reference.model(torch.tensor([prompt])).logits[0, :-1].float()
        want = torch.log_softmax(logits, dim=-1)
        assert len(got) == len(prompt) and got[0] is None
        for pos in range(1, len(prompt)):
            entry = got[pos]
            assert abs(entry[prompt[pos]].logprob - float(want[pos - 1, prompt[pos]])) < 2e-3
            assert len(entry) in (2, 3)
    finally:
        harness.close()


def test_fp8_deepseek_ep2_group_equals_one_process_across_rebalances(tmp_path,
                                                                      default_model_source):
    """Two expert-parallel ranks hold the FP8 experts of their slots (values and scales);
    EPLB moves them (as bytes) between ranks mid-generation; tokens and log-probs equal one
    plain FP8 engine's, which equal transformers' on the dequantized copy."""
    from transformers import AutoModelForCausalLM

    from deepinfer.ep.ep_config import EPConfig
    from deepinfer.moe.eplb_config import EPLBConfig
    from tests.integration.expert_parallel_harness import GroupRunner, one_process_outputs

    fp8_dir, ref_dir = str(tmp_path / "fp8"), str(tmp_path / "ref")
    write_fp8_pair(fp8_hf_model("deepseek_v3_aligned", seed=52), fp8_dir, ref_dir,
                   default_model_source.load_tokenizer())
    reference = TinyReference(AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval())
    prompts = random_prompts(seed=16, lengths=(3, 17, 40, 9, 25, 60))
    want = one_process_outputs(fp8_dir, prompts)
    for prompt, (tokens, _) in zip(prompts, want):
        assert_matches_reference(reference.score(prompt, tokens), "one FP8 process")
    ep = EPConfig(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                  eplb=EPLBConfig(window_size=4, step_interval=3, num_redundant_experts=2))
    group = GroupRunner(fp8_dir, ep)
    try:
        got = group.generate(prompts)
        for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(got, want)):
            assert tokens == ref_tokens, f"prompt {i}: {tokens} != {ref_tokens}"
            assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4, f"prompt {i}"
        eplb = group.client.groups[0]
        assert eplb.num_rebalances >= 2 and eplb.moved_bytes > 0, "no FP8 expert moved"
    finally:
        group.close()
