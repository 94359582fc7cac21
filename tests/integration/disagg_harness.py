"""A disaggregated cluster for tests: its client (`make_client`) on an event loop in a background thread,
so synchronous tests can drive real worker processes over real TCP sockets."""
from __future__ import annotations

import asyncio
import threading
import time

from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.clients.factory import make_client
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.sampling_params import SamplingParams

ENGINE = EngineConfig(dtype="float32", num_kv_blocks=256, num_threads=1, seed=0)


class ClusterHarness:
    def __init__(self, cluster: ClusterConfig, engine: EngineConfig = ENGINE) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = make_client(engine, cluster=cluster)
        self.run(self.client.start(), timeout=300)

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                        stop_after_tokens: int | None = None) -> dict:
        tokens: list[int] = []
        finish = None
        try:
            gen = self.client.generate(request_id, prompt, params)
            async for delta in gen:
                tokens += delta.choices[0].token_ids
                finish = delta.choices[0].finish_reason
                if stop_after_tokens is not None and len(tokens) >= stop_after_tokens:
                    await gen.aclose()  # the client goes away mid-request
                    return {"tokens": tokens, "finish": "disconnected", "error": None}
        except Exception as exc:  # recorded, asserted by the test
            return {"tokens": tokens, "finish": finish, "error": f"{type(exc).__name__}: {exc}"}
        return {"tokens": tokens, "finish": finish, "error": None}

    def generate_many(self, prompts: dict[str, list[int]], params: SamplingParams,
                      timeout: float = 120, **kwargs) -> dict[str, dict]:
        async def all_of():
            results = await asyncio.gather(*[self._generate(rid, p, params, **kwargs)
                                             for rid, p in prompts.items()])
            return dict(zip(prompts, results))
        return self.run(all_of(), timeout)

    def submit_many(self, prompts: dict[str, list[int]], params: SamplingParams):
        """Start requests without waiting; returns a concurrent future of their results."""
        async def all_of():
            results = await asyncio.gather(*[self._generate(rid, p, params)
                                             for rid, p in prompts.items()])
            return dict(zip(prompts, results))
        return asyncio.run_coroutine_threadsafe(all_of(), self.loop)

    def counters(self, worker_id: str):
        return self.client.workers[worker_id].counters

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def is_idle(self, worker_ids) -> bool:
        for wid in worker_ids:
            h = self.client.workers[wid]
            r = h.last_report
            if r is None or r.num_kv_blocks_used or r.num_running_reqs or r.num_waiting_reqs \
                    or h.counters.num_staged or time.monotonic() - h.last_seen > 1.0:
                return False
        return True

    def close(self) -> None:
        try:
            self.run(self.client.shutdown(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
