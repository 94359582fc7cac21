"""Disaggregated serving, P=2 prefill + D=2 decode worker processes over TCP on 127.0.0.1,
with an `fs` shared prefix store. One cluster for the module; the fault tests kill workers
and therefore run last (in file order)."""
from __future__ import annotations

import os
import signal

import pytest

from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.sampling_params import SamplingParams
from tests.integration.disagg_harness import ClusterHarness
from tests.integration.prompt_corpus import _corpus_from, distinct_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvstore")


@pytest.fixture(scope="module")
def cluster(store_dir):
    # Killed workers are detected by their process exiting; the heartbeat timeout only has to
    # avoid false alarms when this 2-core box is saturated by four workers plus the tests.
    harness = ClusterHarness(ClusterConfig(
        num_prefill_workers=2, num_decode_workers=2, kv_store_url=f"fs://{store_dir}",
        heartbeat_timeout_s=10.0, transfer_timeout_s=15.0, stall_timeout_s=60.0,
        debug_transfer_delay_s=0.3))
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def encode(cluster):
    return lambda text: cluster.client.tokenizer.encode(text)


def reference(llm, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_alone_on(cluster, worker_id: str, prompts: dict, params=GREEDY) -> dict:
    """Route only to `worker_id` among prefill workers for these requests."""
    router = cluster.client.prefill_router
    others = [w for w in cluster.client.workers if w.startswith("prefill") and w != worker_id]
    for w in others:
        router.remove_worker(w)
    try:
        return cluster.generate_many(prompts, params)
    finally:
        for w in others:
            router.add_worker(w)


def test_greedy_outputs_equal_colocated_engine(cluster, encode, engine_base_llm):
    prompts = distinct_prompts(encode)[:7]
    results = cluster.generate_many({f"eq-{i}": p for i, p in enumerate(prompts)}, GREEDY)
    expected = reference(engine_base_llm, prompts, GREEDY)
    for i, want in enumerate(expected):
        got = results[f"eq-{i}"]
        assert got["error"] is None and got["tokens"] == want, (i, got, want)
    used = {tuple(cluster.client.placements[f"eq-{i}"]) for i in range(len(prompts))}
    assert {d for _, d in used} == {"decode-0", "decode-1"}  # the decode router spread them


def test_prefix_from_worker_a_is_a_shared_tier_hit_on_worker_b(cluster, encode):
    prompt = encode(_corpus_from(3))[11:11 + 6 * BLOCK + 5]  # unseen: no device hits
    first = run_alone_on(cluster, "prefill-0", {"share-a": prompt})["share-a"]
    cluster.wait_for(lambda: cluster.counters("prefill-0").store_bytes_written > 0
                     and cluster.client.workers["prefill-0"].counters.num_staged == 0,
                     what="write-through of prefill-0")
    cluster.wait_for(lambda: store_has(cluster, prompt, 6), what="6 blocks in the store")
    before = cluster.counters("prefill-1")
    second = run_alone_on(cluster, "prefill-1", {"share-b": prompt})["share-b"]
    cluster.wait_for(lambda: cluster.counters("prefill-1").prefix_query_tokens
                     > before.prefix_query_tokens, what="prefill-1 report")
    after = cluster.counters("prefill-1")
    assert after.store_hit_tokens - before.store_hit_tokens == 6 * BLOCK
    assert after.device_hit_tokens == before.device_hit_tokens
    assert after.store_bytes_read > before.store_bytes_read
    assert second["error"] is None and second["tokens"] == first["tokens"]


def store_files(store_dir, prompt) -> list:
    paths = []
    for block_hash in hash_request_blocks(prompt, BLOCK):
        found = list(store_dir.glob(f"*/*/{block_hash.hex()}*"))
        paths.append(found[0] if found else None)
    return paths


def store_has(cluster, prompt, num_blocks) -> bool:
    store_dir = cluster.client.cluster.kv_store_url.removeprefix("fs://")
    from pathlib import Path
    return all(p is not None for p in store_files(Path(store_dir), prompt)[:num_blocks])


def test_corrupt_store_block_is_detected_and_recomputed(cluster, encode, store_dir):
    prompt = encode(_corpus_from(5))[13:13 + 5 * BLOCK + 3]
    first = run_alone_on(cluster, "prefill-0", {"corrupt-a": prompt})["corrupt-a"]
    cluster.wait_for(lambda: store_has(cluster, prompt, 5), what="5 blocks in the store")
    victim = store_files(store_dir, prompt)[2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip bits in the payload: the checksum must catch it
    victim.write_bytes(bytes(data))
    before = cluster.counters("prefill-1")
    second = run_alone_on(cluster, "prefill-1", {"corrupt-b": prompt})["corrupt-b"]
    cluster.wait_for(lambda: cluster.counters("prefill-1").prefix_query_tokens
                     > before.prefix_query_tokens, what="prefill-1 report")
    after = cluster.counters("prefill-1")
    assert after.store_corrupt_blocks == before.store_corrupt_blocks + 1
    assert after.store_hit_tokens - before.store_hit_tokens == 2 * BLOCK  # blocks before it
    assert second["error"] is None and second["tokens"] == first["tokens"]


def test_client_disconnect_between_prefill_and_decode_frees_both_sides(cluster, encode):
    prompt = encode(_corpus_from(6))[:3 * BLOCK + 7]
    decode_transfers = sum(cluster.counters(w).num_transfers for w in ("decode-0", "decode-1"))
    result = cluster.generate_many({"gone": prompt}, SamplingParams(temperature=0, max_tokens=50),
                                   stop_after_tokens=1)["gone"]
    assert result["finish"] == "disconnected" and len(result["tokens"]) == 1
    cluster.wait_for(lambda: cluster.is_idle(list(cluster.client.workers)), timeout=15,
                     what="every worker idle (no blocks, nothing staged)")
    # The abort reached the decode worker before its (delayed) pull: no KV moved.
    assert sum(cluster.counters(w).num_transfers
               for w in ("decode-0", "decode-1")) == decode_transfers


def check_no_hung_requests(results: dict) -> None:
    for rid, r in results.items():
        assert r["error"] is not None or r["finish"] in ("length", "stop"), (rid, r)


def test_killing_a_decode_worker_under_load(cluster, encode):
    prompts = {f"kd-{i}": encode(_corpus_from(i))[:40 + 8 * i] for i in range(6)}
    future = cluster.submit_many(prompts, SamplingParams(temperature=0, max_tokens=60,
                                                         ignore_eos=True))
    cluster.wait_for(lambda: sum(1 for r in prompts
                                 if (cluster.client.placements.get(r) or [None, None])[1]
                                 == "decode-1") > 0, what="a request on decode-1")
    os.kill(cluster.client.workers["decode-1"].proc.pid, signal.SIGKILL)
    results = future.result(timeout=90)  # nothing hangs
    check_no_hung_requests(results)
    lost = [r for r in prompts if cluster.client.placements[r][1] == "decode-1"]
    assert lost and all("decode-1" in results[r]["error"] for r in lost
                        if results[r]["error"] is not None)
    assert any(results[r]["error"] is None for r in prompts)  # the survivors served theirs
    cluster.wait_for(lambda: cluster.is_idle(["prefill-0", "prefill-1", "decode-0"]),
                     timeout=20, what="survivors idle")
    again = cluster.generate_many({"after-kd": prompts["kd-0"]}, GREEDY)["after-kd"]
    assert again["error"] is None and cluster.client.placements["after-kd"][1] == "decode-0"


def test_killing_a_prefill_worker_under_load(cluster, encode):
    prompts = {f"kp-{i}": encode(_corpus_from(i + 2))[:120 + 16 * i] for i in range(6)}
    retried = cluster.client.num_retried
    future = cluster.submit_many(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                         ignore_eos=True))
    cluster.wait_for(lambda: any((cluster.client.placements.get(r) or [None])[0] == "prefill-0"
                                 for r in prompts), what="a request on prefill-0")
    os.kill(cluster.client.workers["prefill-0"].proc.pid, signal.SIGKILL)
    results = future.result(timeout=90)
    check_no_hung_requests(results)
    assert cluster.client.num_retried > retried  # unstreamed requests moved to prefill-1
    assert sum(1 for r in results.values() if r["error"] is None) >= 1
    cluster.wait_for(lambda: cluster.is_idle(["prefill-1", "decode-0"]), timeout=20,
                     what="survivors idle")
