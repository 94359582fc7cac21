"""A step that raises on one rank of an EP group fails only its request: the group agrees on
the fault in lockstep (ep/lockstep_faults.py), the culprit gets a clear error, the requests
beside it on both ranks finish with the one-process tokens, and the group is not restarted."""
from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer import SamplingParams
from deepinfer.engine.step_faults import DEBUG_FAULT_SEED_ENV
from deepinfer.ep.ep_config import EPConfig
from deepinfer.moe.eplb_config import EPLBConfig
from deepinfer.engine.exceptions import RequestFailedError
from tests.integration.expert_parallel_harness import (GroupRunner, one_process_outputs,
                                                       rank_pids, write_checkpoint)
from tests.integration.moe_checkpoints import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAULT_SEED = 4242  # the injected fault fires in any step that schedules this request
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


async def outcome(group: GroupRunner, prompt, params, rank):
    try:
        return "ok", (await group.collect(prompt, params, rank=rank))[0]
    except RequestFailedError as e:
        return "failed", str(e)


def test_a_step_fault_on_one_rank_fails_only_its_request(tmp_path, default_model_source,
                                                        monkeypatch, capfd):
    directory = write_checkpoint("deepseek_v3", tmp_path, seed=35,
                                 tokenizer=default_model_source.load_tokenizer())
    prompts = random_prompts(seed=6, lengths=(6, 13, 21, 9, 17, 4))
    want = [tokens for tokens, _ in one_process_outputs(directory, prompts, LONG)]
    monkeypatch.setenv(DEBUG_FAULT_SEED_ENV, str(FAULT_SEED))  # the ranks inherit it
    ep = EPConfig(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                  eplb=EPLBConfig(window_size=4, step_interval=3, num_redundant_experts=2),
                  collective_timeout_s=20.0)
    group = GroupRunner(directory, ep)
    try:
        pids = rank_pids(group.client)
        ranks_of = group.client.groups[0].ranks
        bad = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=FAULT_SEED)
        # Prompts 0-2 decode on rank 0 when the bad request joins them there (so rank 0 pins
        # the fault by re-running each of its requests alone), 3-5 on rank 1 (its step is
        # undone and recomputed while rank 0 probes).
        ranks = [0, 0, 0, 1, 1, 1]

        async def fault_under_load():
            good = [asyncio.ensure_future(outcome(group, p, LONG, r))
                    for p, r in zip(prompts, ranks)]
            deadline = time.monotonic() + 60
            while min(h.stats.num_running for h in ranks_of) < 3:
                assert time.monotonic() < deadline, "the requests never ran on both ranks"
                await asyncio.sleep(0.01)
            failed = await outcome(group, prompts[1], bad, 0)
            return failed, await asyncio.wait_for(asyncio.gather(*good), timeout=120)

        failed, results = group.run(fault_under_load())
        assert failed[0] == "failed" and "injected fault" in failed[1] \
            and "other requests were not affected" in failed[1], failed
        for i, (status, tokens) in enumerate(results):
            assert status == "ok" and tokens == want[i], f"prompt {i} on rank {ranks[i]}"
        logs = capfd.readouterr().err  # the ranks' stderr: the step ran beside the others
        assert "rank 0: engine step failed (4 requests scheduled)" in logs
        assert "rank 1: a peer rank's step failed; undoing this rank's step (3 requests" in logs
        stats = [h.stats for h in group.client.groups[0].ranks]
        assert stats[0].num_failed_requests == 1 and stats[1].num_failed_requests == 0
        assert stats[0].num_failed_steps >= 1
        # No restart: the same rank processes, and they keep serving.
        assert group.client.groups[0].healthy and rank_pids(group.client) == pids
        assert [t for t, _ in group.generate(prompts[:2], ranks=[1, 0], params=LONG)] == want[:2]
    finally:
        group.close()
