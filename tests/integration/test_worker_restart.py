"""Self-healing: a SIGKILLed prefill or decode worker of a real P=1/D=1 cluster is restarted by
the front's supervisor, re-admitted after its first report, and serves greedy outputs equal to
the colocated engine; the per-role restart counter moves."""
from __future__ import annotations

import os
import signal

import pytest

from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.cluster.cluster_metrics import ClusterCollector
from deepinfer.sampling_params import SamplingParams
from tests.integration.disagg_harness import ClusterHarness
from tests.integration.prompt_corpus import _corpus_from

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
RESTART_DEADLINE_S = 180.0  # a model load on a saturated 2-core box


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = tmp_path_factory.mktemp("kvstore")
    harness = ClusterHarness(ClusterConfig(
        num_prefill_workers=1, num_decode_workers=1, kv_store_url=f"fs://{store}",
        heartbeat_timeout_s=10.0, stall_timeout_s=60.0, restart_backoff_s=0.2))
    yield harness
    harness.close()


def restart_count(cluster, role: str) -> float:
    """`deepinfer:cluster_worker_restarts_total{role=...}` as a Prometheus scrape sees it."""
    for family in ClusterCollector(cluster.client).collect():
        for sample in family.samples:
            if sample.name == "deepinfer:cluster_worker_restarts_total" \
                    and sample.labels == {"role": role}:
                return sample.value
    raise AssertionError("no deepinfer:cluster_worker_restarts metric")


def kill_and_wait_for_restart(cluster, worker_id: str) -> None:
    handle = cluster.client.workers[worker_id]
    role, old_pid = handle.role, handle.proc.pid
    before = restart_count(cluster, role)
    os.kill(old_pid, signal.SIGKILL)
    cluster.wait_for(lambda: not cluster.client.workers[worker_id].alive, timeout=30,
                     what=f"{worker_id} removed from routing")
    cluster.wait_for(lambda: cluster.client.workers[worker_id].alive, timeout=RESTART_DEADLINE_S,
                     what=f"{worker_id} restarted and re-admitted")
    assert cluster.client.workers[worker_id].proc.pid != old_pid
    assert restart_count(cluster, role) == before + 1
    assert cluster.client.is_healthy


def check_greedy(cluster, engine_base_llm, tag: str, starts: range) -> None:
    encode = cluster.client.tokenizer.encode
    prompts = {f"{tag}-{i}": encode(_corpus_from(i))[:20 + 7 * i] for i in starts}
    results = cluster.generate_many(prompts, GREEDY)
    outs = engine_base_llm.generate([{"prompt_token_ids": p} for p in prompts.values()],
                                    GREEDY, use_tqdm=False)
    for (rid, got), want in zip(results.items(), outs):
        assert got["error"] is None and got["tokens"] == want.outputs[0].token_ids, (rid, got)


def test_killed_prefill_worker_is_restarted_and_serves_equal_outputs(cluster, engine_base_llm):
    check_greedy(cluster, engine_base_llm, "before", range(2))
    kill_and_wait_for_restart(cluster, "prefill-0")
    check_greedy(cluster, engine_base_llm, "after-prefill", range(2, 5))


def test_killed_decode_worker_mid_request_is_restarted(cluster, engine_base_llm):
    encode = cluster.client.tokenizer.encode
    long_params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    future = cluster.submit_many({"in-flight": encode(_corpus_from(6))[:30]}, long_params)
    cluster.wait_for(lambda: (cluster.client.placements.get("in-flight") or [None, None])[1]
                     == "decode-0", what="the request on decode-0")
    kill_and_wait_for_restart(cluster, "decode-0")
    lost = future.result(timeout=60)["in-flight"]
    assert lost["error"] is not None and "decode-0" in lost["error"]  # failed clearly, not hung
    check_greedy(cluster, engine_base_llm, "after-decode", range(5, 8))
    cluster.wait_for(lambda: cluster.is_idle(["prefill-0", "decode-0"]), timeout=30,
                     what="both workers idle (nothing leaked across the restart)")
