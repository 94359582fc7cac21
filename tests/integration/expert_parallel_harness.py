"""Helpers for the expert-parallel tests: tiny MoE checkpoints on disk, the one-process
reference, and a `DataParallelClient` driven from synchronous test code (one event loop per
group, kept for the group's life)."""
from __future__ import annotations

import asyncio
import os
import time

from deepinfer import SamplingParams
from tests.integration.moe_checkpoints import tiny_moe_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


def write_checkpoint(kind: str, directory, seed: int, tokenizer) -> str:
    model = tiny_moe_model(kind, seed=seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def one_process_outputs(directory: str, prompts, params=GREEDY) -> list[tuple[list[int], list[float]]]:
    """(token ids, sampled-token logprobs) per prompt from one plain engine."""
    from deepinfer import LLM
    llm = LLM(model=directory, dtype="float32", seed=0, num_kv_blocks=128, num_threads=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp.logprob for lp in o.outputs[0].logprobs or []])
            for o in outs]


class GroupRunner:
    """A started DataParallelClient plus its event loop."""

    def __init__(self, directory: str, ep_config, engine_kwargs: dict | None = None,
                 **client_kwargs) -> None:
        from deepinfer.engine.engine_config import EngineConfig
        from deepinfer.clients.factory import make_client

        self.loop = asyncio.new_event_loop()
        kwargs = dict(model=directory, dtype="float32", num_kv_blocks=128, num_threads=1, seed=0)
        config = EngineConfig(**{**kwargs, **(engine_kwargs or {})})
        self.client = make_client(config, ep_config=ep_config, ready_timeout_s=180,
                                  **client_kwargs)
        self.run(self.client.start())
        self._ids = 0

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def collect(self, prompt, params=GREEDY, rank=None, on_first_token=None):
        """(token ids, logprobs) of one request; `on_first_token` awaited once when the first
        token arrives (e.g. to force a rebalance mid-generation)."""
        self._ids += 1
        tokens, logprobs = [], []
        async for delta in self.client.generate(f"t{self._ids}", prompt, params, rank=rank):
            choice = delta.choices[0]
            tokens += choice.token_ids
            logprobs += [lp.logprob for lp in choice.logprobs or []]
            if on_first_token is not None and tokens:
                await on_first_token()
                on_first_token = None
        return tokens, logprobs

    def generate(self, prompts, ranks=None, params=GREEDY):
        ranks = ranks or [None] * len(prompts)

        async def all_of_them():
            return await asyncio.gather(*(self.collect(p, params, r) for p, r in zip(prompts, ranks)))
        return self.run(all_of_them())

    def wait_for(self, condition, timeout_s: float = 60.0) -> None:
        """Poll (on the client's loop) until `condition()` holds; AssertionError on timeout."""
        async def poll():
            deadline = time.monotonic() + timeout_s
            while not condition():
                assert time.monotonic() < deadline, "condition not reached in time"
                await asyncio.sleep(0.05)
        self.run(poll())

    def close(self) -> None:
        try:
            self.run(self.client.shutdown())
        finally:
            self.loop.close()


def rank_pids(client) -> list[int]:
    return [h.proc.pid for g in client.groups for h in g.ranks]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
