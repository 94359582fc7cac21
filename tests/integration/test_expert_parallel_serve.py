"""`deepinfer serve --data-parallel-size 2 --enable-expert-parallel --enable-eplb` on a tiny
Qwen3-MoE: the openai client gets the one-process greedy tokens (concurrent requests spread
over both ranks), and /metrics shows per-rank load and the EPLB results (balancedness before
and after, redundant-expert bytes, rebalances, moved bytes)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deepinfer import SamplingParams
from tests.integration.expert_parallel_harness import one_process_outputs, write_checkpoint
from tests.integration.moe_checkpoints import random_prompts
from tests.integration.serve_process import ServeProcess, metric, scrape_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_TOKENS = 10


def test_serve_data_parallel_expert_parallel_with_eplb(tmp_path, default_model_source):
    directory = write_checkpoint("qwen3_moe", tmp_path, seed=35,
                                 tokenizer=default_model_source.load_tokenizer())
    prompts = random_prompts(seed=13, lengths=(4, 30, 12, 50, 7, 21))
    want = [t for t, _ in one_process_outputs(
        directory, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    eplb = {"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}
    server = ServeProcess("--model", directory, "--dtype", "float32", "--threads", "1",
                          "--num-kv-blocks", "128", "--data-parallel-size", "2",
                          "--enable-expert-parallel", "--enable-eplb",
                          "--eplb-config", json.dumps(eplb))
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def complete(ids):
            got = client.completions.create(model=client.models.list().data[0].id, prompt=ids,
                                            max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            return got.choices[0].token_ids

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
        assert got == want

        samples = scrape_metrics(server.url)
        assert metric(samples, "deepinfer:eplb_rebalances_total") >= 1
        assert metric(samples, "deepinfer:eplb_moved_expert_bytes_total") > 0
        # 2 redundant experts x 3 MoE layers x gate/up/down [32 x 64] fp32
        assert metric(samples, "deepinfer:eplb_redundant_expert_bytes") == 2 * 3 * 3 * 32 * 64 * 4
        layers = {k for k in samples if k.startswith("deepinfer:eplb_balancedness{")}
        assert len(layers) == 2 * 3  # before/after x MoE layers
        assert all(0 < samples[k] <= 1 for k in layers)
        ranks = [k for k in samples if k.startswith("deepinfer:dp_rank_num_requests_running{")]
        assert len(ranks) == 2
        assert metric(samples, "deepinfer:dp_group_healthy") == 1
        assert metric(samples, "deepinfer:generation_tokens_total") == MAX_TOKENS * len(prompts)
    finally:
        assert server.stop() == 0, server.output()
