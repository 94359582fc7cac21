"""The hostile-network attack of test_wire_netns.py against the other stages, each in its own
cluster in namespace "cluster" with the attacker in namespace "attack": an expert-parallel
group (`--data-parallel-size 2 --enable-expert-parallel`, tiny random Qwen3-MoE) and an E/P/D
cluster (`--encode-workers 1`, tiny CLIP LLaVA, image requests), and P1 with an EP=2 group as its
decode stage (`--decode-data-parallel-size 2 --enable-expert-parallel`). Every listening TCP port of
the namespace but HTTP is attacked while greedy requests run; their outputs must equal the same
requests' outputs before the attack, no file may appear, and the server still answers the same.
E/P/D: drops are counted and fresh images are encoded under attack. EP: no wire channel is
reachable from another host at all (ipc and 127.0.0.1), so there is nothing to drop."""
from __future__ import annotations

import copy

import httpx
import pytest

from tests.integration.llava_checkpoints import synthetic_image, write_tiny_llava
from tests.integration.moe_checkpoints import tiny_moe_model
from tests.integration.netns import NetnsTopology, require_netns
from tests.integration.netns_serve import (attack_under_load, complete, drops, listeners,
                                           netns_server, wait_for_drops)
from tests.integration.serve_process import metric, scrape_metrics
from tests.integration.test_llava_serve import MEDIA_ARGS, data_url

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["Once upon a time, in a land far away, there lived a king who",
           "The three primary colours are", "def fibonacci(n):"]
COMMON = ("--dtype", "float32", "--threads", "1", "--num-kv-blocks", "128",
          "--max-model-len", "256", "--kv-store", "none")


def _attacked_cluster_answers_the_same(tmp_path, args: tuple[str, ...], ask, min_ports: int,
                                       also=None):
    """Start `serve ARGS` in the namespace, take `ask()` ({key: answer}) as reference, ask
    again while the attacker hits every port, and once more after it. `also(url)`: more work
    run under attack after `ask` (it checks its own results)."""
    require_netns()
    marker = tmp_path / "pwned"
    with NetnsTopology(("cluster", "attack"), root_port=True) as topo:
        server = netns_server(topo, "cluster", *args)
        try:
            server.wait_ready(400)
            want = ask(server.url)
            endpoints = listeners(topo, "cluster")
            assert len(endpoints) >= min_ports, endpoints
            before = drops(server.url)
            got = attack_under_load(topo, "attack", endpoints, marker,
                                    lambda: {**ask(server.url), **_run(also, server.url)})
            assert got == want, server.output()
            if min_ports:
                assert wait_for_drops(server.url, before) > before
            assert not marker.exists()
            assert ask(server.url) == want  # still serving, same answers
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        finally:
            code = server.stop()
        assert code == 0, f"server did not stop cleanly ({code}):\n{server.output()}"
    return endpoints


def _run(also, url: str) -> dict:
    if also is not None:
        also(url)
    return {}


def test_attacker_changes_no_answer_of_an_expert_parallel_group(tmp_path, default_model_source):
    tokenizer = default_model_source.load_tokenizer()
    checkpoint = tmp_path / "moe"
    tiny_moe_model("qwen3_moe", seed=35, vocab_size=len(tokenizer)).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    args = ("--model", str(checkpoint), *COMMON, "--data-parallel-size", "2",
            "--enable-expert-parallel")
    # The ranks talk to the front over ipc sockets and to each other over 127.0.0.1, and rank
    # 0 serves the torch.distributed rendezvous store on a socket bound to 127.0.0.1 (left to
    # itself TCPStore binds every interface), so nothing of the group is reachable from
    # another host: any listener open to the network shows here.
    endpoints = _attacked_cluster_answers_the_same(
        tmp_path, args, lambda url: {p: complete(url, p) for p in PROMPTS}, min_ports=0)
    assert endpoints == [], endpoints


def test_attacker_changes_no_answer_of_a_disaggregated_expert_parallel_decode_group(
        tmp_path, default_model_source):
    # P1 and an EP=2 group as the decode stage: the front's channels to the prefill worker
    # and to each rank, and the prefill worker's KV server, are on the namespace's address.
    tokenizer = default_model_source.load_tokenizer()
    checkpoint = tmp_path / "moe"
    tiny_moe_model("qwen3_moe", seed=36, vocab_size=len(tokenizer)).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    args = ("--model", str(checkpoint), *COMMON, "--prefill-workers", "1",
            "--decode-workers", "1", "--decode-data-parallel-size", "2",
            "--enable-expert-parallel")
    _attacked_cluster_answers_the_same(
        tmp_path, args, lambda url: {p: complete(url, p) for p in PROMPTS}, min_ports=3)


def _chat_image(url: str, seed: int) -> list[int]:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    content = [{"type": "image_url", "image_url": {"url": data_url(synthetic_image(seed))}},
               {"type": "text", "text": "Describe."}]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=180, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _images_encoded(url: str) -> float:
    return metric(scrape_metrics(url), "deepinfer:encode_images_encoded_total")


def test_attacker_changes_no_answer_of_an_encode_stage(tmp_path, default_model_source):
    checkpoint = write_tiny_llava(str(tmp_path / "llava"), "clip",
                                  copy.deepcopy(default_model_source.load_tokenizer()), seed=0)
    args = ("--model", checkpoint, *COMMON[:-2], "--kv-store", f"fs://{tmp_path / 'store'}",
            *MEDIA_ARGS, "--encode-workers", "1", "--prefill-workers", "1",
            "--decode-workers", "1")
    seen: list[float] = []

    def ask(url: str) -> dict:  # the same images each time (their embeddings are cached)
        return {seed: _chat_image(url, seed) for seed in (20, 21)}

    def fresh_images_are_encoded(url: str) -> None:  # and new ones encoded under attack
        before = _images_encoded(url)
        assert all(len(_chat_image(url, seed)) == 8 for seed in (30, 31))
        seen.append(_images_encoded(url) - before)

    _attacked_cluster_answers_the_same(tmp_path, args, ask, min_ports=4,
                                       also=fresh_images_are_encoded)
    assert seen == [2], seen
