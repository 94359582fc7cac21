"""EP groups of 2 and 4 ranks (gloo) give the one-process greedy tokens on tiny DeepSeek-V3
(MLA, grouped sigmoid routing) and Qwen3-MoE checkpoints (fp32), with EPLB on: rebalances
every 3 group steps (so several happen in the middle of every generation, with redundant
experts moved between ranks) plus one forced from the front mid-stream. A rank's outputs do
not depend on what the other ranks run in the same steps."""
from __future__ import annotations

import pytest

from deepinfer.ep.ep_config import EPConfig
from deepinfer.moe.eplb_config import EPLBConfig
from tests.integration.expert_parallel_harness import (GroupRunner, one_process_outputs,
                                                       write_checkpoint)
from tests.integration.moe_checkpoints import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# With the serve test (Qwen3-MoE, 2 ranks) and the fault test (DeepSeek-V3, 2 ranks) every
# model x group size is covered; both dispatchers run with 4 ranks.
# The second plans its scheduled rebalances off the step path (applied 2 steps after the due
# step, on every rank at once).
CASES = [("deepseek_v3", 4, "alltoall", 0), ("qwen3_moe", 4, "allgather_reducescatter", 2)]


def assert_equal(got, want, label: str) -> None:
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(got, want)):
        assert tokens == ref_tokens, f"{label} prompt {i}: {tokens} != {ref_tokens}"
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4, f"{label} prompt {i}"


@pytest.mark.parametrize("kind, world, backend, plan_ahead", CASES)
def test_ep_group_equals_one_process_across_rebalances(kind, world, backend, plan_ahead, tmp_path,
                                                       default_model_source):
    directory = write_checkpoint(kind, tmp_path, seed=31, tokenizer=default_model_source.load_tokenizer())
    prompts = random_prompts(seed=9, lengths=(3, 17, 40, 9, 25, 5, 60, 12))
    want = one_process_outputs(directory, prompts)
    ep = EPConfig(data_parallel_size=world, enable_expert_parallel=True, dispatcher=backend,
                  enable_eplb=True, eplb=EPLBConfig(window_size=4, step_interval=3,
                                                    num_redundant_experts=world,
                                                    plan_ahead_steps=plan_ahead))
    group = GroupRunner(directory, ep)
    try:
        client = group.client
        # 1. Routed by load over every rank at once.
        assert_equal(group.generate(prompts), want, "routed")
        eplb = client.groups[0]
        assert eplb.num_rebalances >= 3 and eplb.moved_bytes > 0, "no expert moved mid-generation"
        assert client.redundant_expert_bytes > 0

        # 2. Rank 0 alone (the others run empty steps), then beside other requests.
        alone = group.generate(prompts[:3], ranks=[0, 0, 0])
        others = prompts[3:] * 2
        mixed = group.generate(prompts[:3] + others,
                               ranks=[0, 0, 0] + [1 + i % (world - 1) for i in range(len(others))])
        assert_equal(alone, want[:3], "rank 0 alone")
        assert_equal(mixed[:3], want[:3], "rank 0 beside other ranks' requests")

        # 3. A rebalance forced from the front after the first streamed token.
        before = eplb.num_rebalances
        forced = group.run(group.collect(prompts[6], on_first_token=client.rebalance_now))
        assert_equal([forced], [want[6]], "forced rebalance")
        assert eplb.num_rebalances > before
    finally:
        group.close()
