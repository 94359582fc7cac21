"""An expert-parallel group as the disaggregated decode stage: one prefill worker hands KV to
the rank of a 2-rank EP decode group that the decode router picked; the ranks step in lockstep
for the MoE collectives. Greedy outputs equal one plain process (tiny DeepSeek-V3 with EPLB
rebalancing mid-generation, tiny Qwen3-MoE), over HTTP; a rank killed under load takes its
group out at once (no hung request; only requests that had streamed tokens fail, clearly), and
the group is restarted as a whole and serves correctly again."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import openai
import pytest

from deepinfer import SamplingParams
from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.ep.ep_config import EPConfig
from deepinfer.ep.ep_disagg_client import EPDisaggClient
from deepinfer.server.engine_client import EngineDeadError
from tests.integration.expert_parallel_harness import one_process_outputs, write_checkpoint
from tests.integration.moe_checkpoints import random_prompts
from tests.integration.serve_process import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EPLB = {"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}


@pytest.mark.parametrize("kind, eplb", [("deepseek_v3", True), ("qwen3_moe", False)])
def test_serve_p1_with_ep_decode_group_equals_one_process(kind, eplb, tmp_path,
                                                          default_model_source):
    directory = write_checkpoint(kind, tmp_path / "model", seed=31,
                                 tokenizer=default_model_source.load_tokenizer())
    prompts = random_prompts(seed=9, lengths=(3, 17, 40, 9, 25, 5))
    want = [tokens for tokens, _ in one_process_outputs(directory, prompts)]
    flags = ["--enable-eplb", "--eplb-config", json.dumps(EPLB)] if eplb else []
    server = ServeProcess("--model", directory, "--dtype", "float32", "--threads", "1",
                          "--num-kv-blocks", "128", "--kv-store", "none",
                          "--prefill-workers", "1", "--decode-workers", "1",
                          "--decode-data-parallel-size", "2", "--enable-expert-parallel", *flags)
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        got: dict[int, list[int]] = {}

        def ask(i: int) -> None:
            reply = client.completions.create(
                model=model, prompt=prompts[i], max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            got[i] = reply.choices[0].token_ids

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [got.get(i) for i in range(len(prompts))] == want
        import httpx
        workers = httpx.get(f"{server.url}/admin/workers", timeout=10).json()
        decode = [w for w in workers["workers"] if w["role"] == "decode"]
        assert [w["state"] for w in decode] == ["alive", "alive"], decode  # each rank routed
    finally:
        assert server.stop() == 0, f"server did not stop cleanly:\n{server.output()}"


class _Front:
    """An EPDisaggClient on its own event loop thread, driven from the test."""

    def __init__(self, directory: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        engine = EngineConfig(model=directory, dtype="float32", num_kv_blocks=128, num_threads=1,
                              seed=0)
        cluster = ClusterConfig(num_prefill_workers=1, num_decode_workers=1, kv_store_url="none",
                                restart_backoff_s=0.2)
        ep = EPConfig(data_parallel_size=2, enable_expert_parallel=True, collective_timeout_s=30)
        self.client = EPDisaggClient(engine, cluster, ep)
        self.run(self.client.start(), 240)

    def run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coros):
        """Run `coros` concurrently on the front's loop; a future of their results."""
        async def all_of(items):
            return await asyncio.gather(*items)
        return asyncio.run_coroutine_threadsafe(all_of(list(coros)), self.loop)

    async def outcome(self, request_id: str, prompt, params, streamed: dict):
        tokens = streamed.setdefault(request_id, [])
        try:
            async for delta in self.client.generate(request_id, prompt, params):
                tokens += delta.choices[0].token_ids
        except EngineDeadError as e:
            return "error", str(e)
        return "ok", tokens

    def close(self) -> None:
        try:
            self.run(self.client.shutdown(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def _wait(condition, timeout_s: float, what: str) -> None:
    import time
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_rank_killed_under_load_takes_out_its_group_and_nothing_hangs(tmp_path,
                                                                      default_model_source):
    directory = write_checkpoint("deepseek_v3", tmp_path / "model", seed=31,
                                 tokenizer=default_model_source.load_tokenizer())
    prompts = random_prompts(seed=5, lengths=(4, 11, 23, 7, 30, 16))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    want = [tokens for tokens, _ in one_process_outputs(directory, prompts, params)]
    front = _Front(directory)
    try:
        client = front.client
        ranks = [client.workers["decode-0"], client.workers["decode-1"]]
        old_pids = [h.proc.pid for h in ranks]
        streamed: dict[str, list[int]] = {}
        future = front.submit(front.outcome(f"load-{i}", p, params, streamed)
                              for i, p in enumerate(prompts))
        # Kill rank 1 once both ranks decode (each holds a request that has streamed tokens).
        _wait(lambda: all(h.request_ids for h in ranks) and
              sum(len(t) > 2 for t in streamed.values()) >= 2, 120, "both ranks decoding")
        os.kill(old_pids[1], signal.SIGKILL)
        results = future.result(120)  # nothing hangs
        for (status, value), ref in zip(results, want):
            if status == "ok":
                assert value == ref
        errors = [value for status, value in results if status == "error"]
        assert errors, "the kill interrupted nothing"
        assert any("group 0 lost" in e for e in errors), errors  # rank 0's requests say why
        # Rank 0 went out with rank 1 (killed, not left waiting on a collective timeout).
        assert not ranks[0].alive and ranks[0].dead_reason is not None
        assert "group 0 lost" in ranks[0].dead_reason
        # The group comes back as a whole (new processes) and decodes correctly again.
        _wait(lambda: all(h.alive for h in ranks), 180, "the group restarted")
        assert all(h.proc.pid != old for h, old in zip(ranks, old_pids))
        again = front.submit(front.outcome(f"after-{i}", p, params, {})
                             for i, p in enumerate(prompts[:4])).result(120)
        assert [value for _, value in again] == want[:4]
    finally:
        front.close()
