"""Disaggregated serving with a Redis shared prefix store (the test starts its own
redis-server): P=2 prefill + D=1 decode worker processes over TCP on 127.0.0.1."""
from __future__ import annotations

import pytest
import redis

from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.sampling_params import SamplingParams
from tests.integration.disagg_harness import ClusterHarness
from tests.integration.prompt_corpus import _corpus_from, distinct_prompts
from tests.integration.redis_server import running_redis_server
from tests.integration.test_disagg_cluster import BLOCK, GREEDY, reference, run_alone_on

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster():
    with running_redis_server() as url:
        harness = ClusterHarness(ClusterConfig(
            num_prefill_workers=2, num_decode_workers=1, kv_store_url=url,
            heartbeat_timeout_s=10.0, transfer_timeout_s=15.0, stall_timeout_s=60.0))
        yield harness
        harness.close()


def test_p1_d1_path_greedy_outputs_equal_colocated_engine(cluster, engine_base_llm):
    """Every request through prefill-0 and decode-0 only: the P=1/D=1 path."""
    encode = cluster.client.tokenizer.encode
    prompts = distinct_prompts(encode)[1:6]
    results = run_alone_on(cluster, "prefill-0", {f"p1-{i}": p for i, p in enumerate(prompts)})
    for i, want in enumerate(reference(engine_base_llm, prompts, GREEDY)):
        got = results[f"p1-{i}"]
        assert got["error"] is None and got["tokens"] == want, (i, got, want)
        assert cluster.client.placements[f"p1-{i}"] == ["prefill-0", "decode-0"]


def test_prefix_from_worker_a_is_a_shared_tier_hit_on_worker_b_redis(cluster):
    encode = cluster.client.tokenizer.encode
    prompt = encode(_corpus_from(4))[9:9 + 4 * BLOCK + 2]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = run_alone_on(cluster, "prefill-0", {"r-a": prompt}, params)["r-a"]
    # Write-through is asynchronous: wait until every full block of the prompt is in Redis.
    raw = redis.Redis.from_url(cluster.client.cluster.kv_store_url)
    keys = [f"deepinfer:kv:*:{h.hex()}" for h in hash_request_blocks(prompt, BLOCK)]
    assert len(keys) == 4
    cluster.wait_for(lambda: all(raw.keys(pattern) for pattern in keys),
                     what="write-through of the prompt's 4 blocks by prefill-0")
    raw.close()
    before = cluster.counters("prefill-1")
    second = run_alone_on(cluster, "prefill-1", {"r-b": prompt}, params)["r-b"]
    cluster.wait_for(lambda: cluster.counters("prefill-1").prefix_query_tokens
                     > before.prefix_query_tokens, what="prefill-1 report")
    after = cluster.counters("prefill-1")
    assert after.store_hit_tokens - before.store_hit_tokens == 4 * BLOCK
    assert after.device_hit_tokens == before.device_hit_tokens
    assert second["error"] is None and second["tokens"] == first["tokens"]
