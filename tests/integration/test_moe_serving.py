"""A tiny DeepSeek-V3 checkpoint (MLA latent cache, grouped routing) served for real:
`deepinfer serve --model <dir>` answers the official `openai` client with the transformers
greedy tokens, and a disaggregated cluster (2 prefill + 1 decode worker processes, `fs`
shared store) equals the colocated engine: the latent KV is transferred to the decode worker
and, written by one prefill worker, read back from the store by the other."""
from __future__ import annotations

import openai
import pytest

from deepinfer import SamplingParams
from tests.integration.hf_reference import assert_matches_reference
from tests.integration.moe_checkpoints import random_prompts, tiny_moe_model
from tests.integration.test_moe_engine_reference import TinyReference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, default_model_source):
    model = tiny_moe_model("deepseek_v3", seed=41)
    directory = tmp_path_factory.mktemp("serve_deepseek_v3")
    model.save_pretrained(directory)
    default_model_source.load_tokenizer().save_pretrained(directory)
    return str(directory), TinyReference(model)


def test_serve_tiny_deepseek_answers_openai_client_with_reference_tokens(deepseek_dir):
    from tests.integration.serve_process import ServeProcess

    directory, reference = deepseek_dir
    server = ServeProcess("--model", directory, "--dtype", "float32", "--threads", "1",
                          "--num-kv-blocks", "128")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for ids in random_prompts(seed=11, lengths=(5, 33, 90)):
            got = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            tokens = got.choices[0].token_ids
            assert len(tokens) == 10
            ref = reference.score(ids, tokens)
            assert_matches_reference(ref, f"served prompt of {len(ids)}")
            assert ref.num_checked_tokens >= 8
        # Streaming runs the same engine path; the tiny vocab (256) rejects tokenizer ids above it.
        stream = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == got.choices[0].text
        with pytest.raises(openai.BadRequestError, match="vocabulary"):
            client.completions.create(model=model, prompt=[300], max_tokens=2)
    finally:
        assert server.stop() == 0, "server did not stop cleanly"


def test_disaggregated_deepseek_equals_colocated_and_shares_latent_blocks(deepseek_dir, tmp_path):
    from deepinfer import LLM
    from deepinfer.cluster.cluster_config import ClusterConfig
    from deepinfer.engine.engine_config import EngineConfig
    from tests.integration.disagg_harness import ClusterHarness

    directory, reference = deepseek_dir
    prompts = random_prompts(seed=12, lengths=(9, 40, 120))
    colocated = LLM(model=directory, dtype="float32", seed=0, num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in colocated.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    for p, tokens in zip(prompts, want):
        assert_matches_reference(reference.score(p, tokens), "colocated")

    harness = ClusterHarness(
        ClusterConfig(num_prefill_workers=2, num_decode_workers=1, kv_store_url=f"fs://{tmp_path}",
                      heartbeat_timeout_s=10.0, transfer_timeout_s=15.0, stall_timeout_s=60.0),
        EngineConfig(model=directory, dtype="float32", num_kv_blocks=128, num_threads=1, seed=0))
    try:
        results = harness.generate_many({f"eq-{i}": p for i, p in enumerate(prompts)}, GREEDY)
        for i, tokens in enumerate(want):
            got = results[f"eq-{i}"]
            assert got["error"] is None and got["tokens"] == tokens, (i, got, tokens)
        assert sum(harness.counters(w).transfer_bytes for w in harness.client.workers
                   if w.startswith("decode")) > 0

        # A prompt prefilled on prefill-0 only, then on prefill-1 only: 6 full latent blocks
        # come from the shared store, and the tokens stay the same.
        shared = random_prompts(seed=13, lengths=(6 * BLOCK + 5,))[0]
        router = harness.client.prefill_router

        def run_on(worker: str, request_id: str):
            other = "prefill-1" if worker == "prefill-0" else "prefill-0"
            router.remove_worker(other)
            try:
                return harness.generate_many({request_id: shared}, GREEDY)[request_id]
            finally:
                router.add_worker(other)

        first = run_on("prefill-0", "share-a")
        harness.wait_for(lambda: harness.counters("prefill-0").store_bytes_written > 0
                         and harness.client.workers["prefill-0"].counters.num_staged == 0,
                         timeout=60, what="write-through of prefill-0")
        before = harness.counters("prefill-1")
        second = run_on("prefill-1", "share-b")
        harness.wait_for(lambda: harness.counters("prefill-1").prefix_query_tokens
                         > before.prefix_query_tokens, timeout=60, what="prefill-1 report")
        after = harness.counters("prefill-1")
        assert after.store_hit_tokens - before.store_hit_tokens == 6 * BLOCK
        assert first["error"] is None and second["error"] is None
        assert second["tokens"] == first["tokens"]
        assert_matches_reference(reference.score(shared, first["tokens"]), "store hit")
    finally:
        harness.close()
