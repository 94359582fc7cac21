"""Disaggregated serving, P=2 prefill + D=2 decode worker processes over TCP on 127.0.0.1,
with an `fs` shared prefix store. One cluster for the module; the fault tests hang, stop and
kill workers and therefore run last (in file order)."""
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
    # A hung or stopped worker is suspended after 10 s and only declared lost (killed) after
    # 120 s, so the tests can watch it come back; staged KV lives 600 s unless released, so a
    # leak shows.
    harness = ClusterHarness(ClusterConfig(
        num_prefill_workers=2, num_decode_workers=2, kv_store_url=f"fs://{store_dir}",
        heartbeat_timeout_s=10.0, transfer_timeout_s=15.0, stall_timeout_s=60.0,
        loop_stall_timeout_s=10.0, hung_restart_after_s=120.0, kv_stage_ttl_s=600.0,
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
    """Route only to `worker_id` among its role's workers for these requests."""
    role = worker_id.split("-")[0]
    router = cluster.client.prefill_router if role == "prefill" else cluster.client.decode_router
    others = [w for w in cluster.client.workers if w.startswith(role) and w != worker_id]
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


def test_a_salted_prefix_in_the_store_is_only_found_with_its_salt(cluster, encode):
    """cache_salt keys the store tier as it keys the device cache: tenant A's stored blocks
    are not loaded for an unsalted request nor for tenant B, and are for tenant A."""
    prompt = encode(_corpus_from(4))[17:17 + 6 * BLOCK + 5]  # unseen: no device hits
    salted = {s: SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, cache_salt=s)
              for s in ("tenant-a", "tenant-b")}
    first = run_alone_on(cluster, "prefill-0", {"salt-a0": prompt}, salted["tenant-a"])["salt-a0"]
    cluster.wait_for(lambda: store_has(cluster, prompt, 6, "tenant-a"),
                     what="6 salted blocks in the store")
    for rid, params, hit_blocks in [("salt-none", GREEDY, 0), ("salt-b", salted["tenant-b"], 0),
                                    ("salt-a1", salted["tenant-a"], 6)]:
        before = cluster.counters("prefill-1")
        got = run_alone_on(cluster, "prefill-1", {rid: prompt}, params)[rid]
        cluster.wait_for(lambda: cluster.counters("prefill-1").prefix_query_tokens
                         > before.prefix_query_tokens, what="prefill-1 report")
        after = cluster.counters("prefill-1")
        assert after.store_hit_tokens - before.store_hit_tokens == hit_blocks * BLOCK, rid
        assert after.device_hit_tokens == before.device_hit_tokens, rid
        assert got["error"] is None and got["tokens"] == first["tokens"], rid
    assert not store_has(cluster, prompt, 1, "tenant-c")


def store_files(store_dir, prompt, cache_salt=None) -> list:
    paths = []
    for block_hash in hash_request_blocks(prompt, BLOCK, cache_salt=cache_salt):
        found = list(store_dir.glob(f"*/*/{block_hash.hex()}*"))
        paths.append(found[0] if found else None)
    return paths


def store_has(cluster, prompt, num_blocks, cache_salt=None) -> bool:
    store_dir = cluster.client.cluster.kv_store_url.removeprefix("fs://")
    from pathlib import Path
    return all(p is not None for p in store_files(Path(store_dir), prompt, cache_salt)[:num_blocks])


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


def live_workers(cluster) -> list[str]:
    return [w for w, h in cluster.client.workers.items() if h.alive]


def test_a_worker_whose_engine_loop_hangs_leaves_routing_and_comes_back(
        cluster, encode, engine_base_llm, tmp_path):
    client = cluster.client
    handle = client.workers["prefill-1"]
    pid, retried = handle.proc.pid, client.health.num_retried
    prompt = encode(_corpus_from(7))[:50]
    release = tmp_path / "release-prefill-1"
    try:
        # prefill-1's loop hangs (its heartbeat thread keeps beating) right after taking the
        # request: the request sits in its input queue.
        cluster.run(client.hang_worker_loop("prefill-1", str(release)))
        client.prefill_router.remove_worker("prefill-0")
        future = cluster.submit_many({"hang-0": prompt}, GREEDY)
        cluster.wait_for(lambda: (client.placements.get("hang-0") or [None])[0] == "prefill-1",
                         what="hang-0 on prefill-1")
        client.prefill_router.add_worker("prefill-0")
        cluster.wait_for(lambda: not handle.alive, timeout=60, what="prefill-1 suspended")
        assert "engine loop has not advanced" in handle.dead_reason
        first = future.result(timeout=90)["hang-0"]  # retried on prefill-0
        assert client.health.num_retried == retried + 1 and client.placements["hang-0"][0] == "prefill-0"
        more = cluster.generate_many({f"hang-{i}": encode(_corpus_from(i))[:30 + i]
                                      for i in range(1, 4)}, GREEDY)
        assert {client.placements[r][0] for r in more} == {"prefill-0"}  # out of routing
    finally:
        client.prefill_router.add_worker("prefill-0")
        release.touch()
    cluster.wait_for(lambda: handle.alive, timeout=60, what="prefill-1 back in routing")
    assert handle.proc.pid == pid  # the same process recovered: not killed, not replaced
    again = run_alone_on(cluster, "prefill-1", {"hang-again": prompt})["hang-again"]
    want = reference(engine_base_llm, [prompt], GREEDY)[0]
    assert first["error"] is None and first["tokens"] == want
    assert again["error"] is None and again["tokens"] == want
    assert all(r["error"] is None for r in more.values())
    # It read the abort sent when it was suspended: the moved request left nothing there.
    cluster.wait_for(lambda: cluster.is_idle(live_workers(cluster)), timeout=30,
                     what="every worker idle")


def test_a_stopped_decode_worker_fails_its_requests_and_is_readmitted_after_sigcont(
        cluster, encode, engine_base_llm):
    client = cluster.client
    handle = client.workers["decode-1"]
    pid = handle.proc.pid
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    client.decode_router.remove_worker("decode-0")
    future = cluster.submit_many({"stopped": encode(_corpus_from(8))[:40]}, long)
    try:
        cluster.wait_for(lambda: "stopped" in client._requests
                         and client._requests["stopped"].num_tokens_streamed > 3,
                         what="the request decoding on decode-1")
        client.decode_router.add_worker("decode-0")
        os.kill(pid, signal.SIGSTOP)
        cluster.wait_for(lambda: not handle.alive, timeout=60, what="decode-1 suspended")
        # A stopped process is caught by whichever check fires first: its heartbeats stop, and
        # the loop age the front keeps for it passes the stall limit.
        assert ("missed heartbeats" in handle.dead_reason
                or "engine loop has not advanced" in handle.dead_reason), handle.dead_reason
        lost = future.result(timeout=60)["stopped"]  # failed clearly, not hung
        assert lost["error"] is not None and "decode-1" in lost["error"], lost
        prompts = {f"stop-{i}": encode(_corpus_from(i))[:25 + i] for i in range(3)}
        served = cluster.generate_many(prompts, GREEDY)
        assert {client.placements[r][1] for r in prompts} == {"decode-0"}
        want = reference(engine_base_llm, list(prompts.values()), GREEDY)
        assert [served[r]["tokens"] for r in prompts] == want
    finally:
        client.decode_router.add_worker("decode-0")
        os.kill(pid, signal.SIGCONT)
    cluster.wait_for(lambda: handle.alive, timeout=60, what="decode-1 back in routing")
    assert handle.proc.pid == pid and client.is_healthy
    again = run_alone_on(cluster, "decode-1", {"after-stop": prompts["stop-0"]})["after-stop"]
    assert again["error"] is None and again["tokens"] == want[0]
    # The abort sent while it was stopped freed the failed request's blocks.
    cluster.wait_for(lambda: cluster.is_idle(live_workers(cluster)), timeout=30,
                     what="every worker idle")


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


def test_killing_a_prefill_worker_under_load(cluster, encode, engine_base_llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {f"kp-{i}": encode(_corpus_from(i + 2))[:120 + 16 * i] for i in range(6)}
    want = dict(zip(prompts, reference(engine_base_llm, list(prompts.values()), params)))
    retried = cluster.client.health.num_retried
    future = cluster.submit_many(prompts, params)
    cluster.wait_for(lambda: any((cluster.client.placements.get(r) or [None])[0] == "prefill-0"
                                 for r in prompts), what="a request on prefill-0")
    os.kill(cluster.client.workers["prefill-0"].proc.pid, signal.SIGKILL)
    results = future.result(timeout=90)  # none hangs
    check_no_hung_requests(results)
    # Every request either completed with exactly the colocated engine's tokens, or failed
    # with an error naming the lost worker (its first token was streamed before the kill).
    for rid, r in results.items():
        if r["error"] is None:
            assert r["tokens"] == want[rid], rid
        else:
            assert "prefill-0" in r["error"], (rid, r)
            assert "was lost" in r["error"] or "stopped responding" in r["error"], (rid, r)
    assert cluster.client.health.num_retried > retried  # unstreamed requests moved to prefill-1
    assert sum(1 for r in results.values() if r["error"] is None) >= 1
    # No KV left anywhere: nothing staged, no blocks in use, no transfer pending on any live
    # worker (including a replacement the supervisor may have started meanwhile).
    cluster.wait_for(lambda: cluster.is_idle(live_workers(cluster)), timeout=30,
                     what="every live worker idle")
    assert {"prefill-1", "decode-0"} <= set(live_workers(cluster))
