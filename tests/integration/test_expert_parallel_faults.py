"""Faults in EP groups: a rank that dies (SIGKILL) or hangs (SIGSTOP) takes its group out of
routing, its requests end (clear error; retried on the other group when nothing was streamed),
nothing hangs, the other group keeps serving, and the lost group is restarted."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from deepinfer import SamplingParams
from deepinfer.ep.ep_config import EPConfig
from deepinfer.moe.eplb_config import EPLBConfig
from deepinfer.engine.exceptions import EngineDeadError
from deepinfer.clients.engine_supervisor import EngineRestartPolicy
from tests.integration.expert_parallel_harness import (GroupRunner, alive, one_process_outputs,
                                                       write_checkpoint)
from tests.integration.moe_checkpoints import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
COLLECTIVE_TIMEOUT_S = 3.0


async def outcome(group: GroupRunner, prompt, rank=None):
    """('ok', tokens) or ('error', message), and whether any token had been streamed."""
    streamed = []
    try:
        async for delta in group.client.generate(f"f{id(streamed)}-{time.monotonic()}", prompt,
                                                 LONG, rank=rank):
            streamed += delta.choices[0].token_ids
    except EngineDeadError as e:
        return "error", str(e), streamed
    return "ok", streamed, streamed


def test_dead_or_hung_rank_takes_out_only_its_group(tmp_path, default_model_source):
    directory = write_checkpoint("deepseek_v3", tmp_path, seed=33,
                                 tokenizer=default_model_source.load_tokenizer())
    prompts = random_prompts(seed=4, lengths=(5, 9, 14, 20, 7, 11, 3, 16))
    want = [tokens for tokens, _ in one_process_outputs(directory, prompts, LONG)]
    ep = EPConfig(data_parallel_size=2, enable_expert_parallel=True, num_groups=2,
                  enable_eplb=True, eplb=EPLBConfig(window_size=4, step_interval=5,
                                                    num_redundant_experts=2),
                  collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    # One running sequence per rank: the rest wait in the scheduler (nothing streamed yet).
    group = GroupRunner(directory, ep, engine_kwargs={"max_num_seqs": 1},
                        restart_policy=EngineRestartPolicy(max_restarts=2, initial_backoff_s=0.2,
                                                           max_backoff_s=1.0))
    client = group.client
    try:
        # --- SIGKILL rank 1 of group 0 while every rank is busy and requests are queued.
        victim = client.groups[0].ranks[1].proc.pid
        partner = client.groups[0].ranks[0].proc.pid

        async def kill_under_load():
            tasks = [asyncio.ensure_future(outcome(group, p, rank=i % 4 if i < 4 else None))
                     for i, p in enumerate(prompts)]
            while not client.groups[0].ranks[1].stats.num_running:
                await asyncio.sleep(0.02)
            os.kill(victim, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)  # no hang

        results = group.run(kill_under_load())
        for i, (status, value, streamed) in enumerate(results):
            if status == "ok":
                assert value == want[i], f"prompt {i} finished with wrong tokens"
            else:
                assert "group 0 lost: rank 1 was killed by SIGKILL" in value, value
        failed = [i for i, r in enumerate(results) if r[0] == "error"]
        assert failed and all(i in (0, 1) or results[i][2] for i in failed), \
            "a request with nothing streamed failed instead of moving to group 1"
        assert all(results[i][0] == "ok" for i in (2, 3)), "group 1 requests were disturbed"
        # The front fails the requests first, then kills the group's ranks: poll, bounded.
        group.wait_for(lambda: not alive(victim) and not alive(partner), timeout_s=30)

        # --- the survivors keep serving; group 0 comes back.
        assert client.is_healthy and client.groups[1].healthy
        assert [t for t, _ in group.generate(prompts[:2], params=LONG)] == want[:2]
        group.wait_for(lambda: client.groups[0].healthy, timeout_s=120)
        assert client.num_restarts == 1
        assert group.run(outcome(group, prompts[5], rank=1))[1] == want[5]

        # --- SIGSTOP a rank of group 1 mid-request: its peer's collective times out.
        hung = client.groups[1].ranks[0].proc.pid

        async def hang_under_load():
            task = asyncio.ensure_future(outcome(group, prompts[6], rank=3))
            while not client.groups[1].ranks[1].stats.num_running:
                await asyncio.sleep(0.02)
            os.kill(hung, signal.SIGSTOP)
            return await asyncio.wait_for(task, timeout=COLLECTIVE_TIMEOUT_S + 60)

        status, message, _ = group.run(hang_under_load())
        assert status == "error" and "group 1 lost" in message, message
        group.wait_for(lambda: not alive(hung) or _is_zombie(hung), timeout_s=30)  # killed too
        assert [t for t, _ in group.generate(prompts[:1], params=LONG)] == want[:1]  # group 0 serves
    finally:
        group.close()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return False
