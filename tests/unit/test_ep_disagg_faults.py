"""`EPDisaggClient` (the disaggregated front whose decode workers are expert-parallel groups)
against fake workers: real ZMQ sockets, no model, no processes (the fake side of
test_disagg_client_faults.py). A lost rank takes its whole group out of routing; a request the
group streamed nothing for, whose KV is still staged on its prefill worker, is sent to a rank
of the other group; one whose KV had arrived fails with a clear error; rank 0's EPLB reports
reach /metrics per decode group."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.wire.worker_messages import DecodeRequest, WorkerFailed
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.ep.decode_rank import EPRankSpec
from deepinfer.ep.ep_config import EPConfig
from deepinfer.clients.ep_disagg import EPDisaggClient
from deepinfer.wire.ep_messages import EPLBStats, WorkerEPLBStats
from deepinfer.engine.exceptions import EngineDeadError
from deepinfer.wire.engine_messages import ChoiceDelta, RequestDelta, RequestError
from tests.unit.test_disagg_client_faults import (BLOCK, FakeWorker, consume, drive_front,
                                                  first_token, until)

pytestmark = pytest.mark.timeout(60)
RANKS = ("d0", "d1", "d2", "d3")  # groups {d0, d1} and {d2, d3}


def run_ep_front(test):
    """Run `test(client, workers)` on a front with a fake prefill worker p0 and two fake
    expert-parallel decode groups of 2 ranks."""
    ep = EPConfig(data_parallel_size=2, enable_expert_parallel=True)

    async def main():
        client = EPDisaggClient(EngineConfig(block_size=BLOCK), ClusterConfig(
            num_prefill_workers=1, num_decode_workers=2, heartbeat_timeout_s=60.0,
            kv_store_url="none", max_worker_restarts=0), ep)
        ctx = zmq.Context()
        workers = {"p0": FakeWorker(client, ctx, "p0", "prefill")}
        for i, wid in enumerate(RANKS):
            workers[wid] = w = FakeWorker(client, ctx, wid, "decode")
            w.handle.spec = dataclasses.replace(w.handle.spec,
                                                ep_rank=EPRankSpec(ep, i // 2, i % 2, 0))
        await drive_front(client, ctx, workers, test)
    asyncio.run(main())


async def to_decode_rank(client, workers, request_id: str):
    """Start a request, play its prefill; -> (task, the decode rank it went to)."""
    task = asyncio.create_task(consume(client, request_id))
    await until(lambda: request_id in client.placements, "the request routed")
    first_token(request_id, workers["p0"])
    await until(lambda: client.placements[request_id][1] is not None, "decode routing")
    rank = workers[client.placements[request_id][1]]
    await rank.expect(DecodeRequest)
    return task, rank


def group_of(wid: str) -> list[str]:
    i = RANKS.index(wid) // 2 * 2
    return list(RANKS[i:i + 2])


def test_a_lost_rank_s_request_with_its_kv_still_staged_moves_to_the_other_group():
    async def test(client, workers):
        task, rank = await to_decode_rank(client, workers, "r")
        lost = group_of(rank.worker_id)
        rank.send(WorkerFailed(rank.worker_id, "Traceback ...\nRuntimeError: boom"))
        # The request goes, as it was, to a rank of the other group (which pulls the KV).
        await until(lambda: client.placements["r"][1] not in lost, "decode routed elsewhere",
                    timeout=20)
        again = workers[client.placements["r"][1]]
        resent = await again.expect(DecodeRequest)
        assert (resent.first_token_id, resent.kv_source_addr) == (5, "tcp://127.0.0.1:1")
        assert not any(client.workers[w].alive for w in lost)  # the group went out as one
        again.report(kv_received=["r"], outputs=[RequestDelta(
            "r", [ChoiceDelta(0, "b", [6], finish_reason="length")], True)])
        result = await asyncio.wait_for(task, 20)
        assert result == {"tokens": [5, 6], "error": None}
        assert client.health.num_retried == 1
    run_ep_front(test)


def test_a_lost_rank_s_request_whose_kv_had_arrived_fails_clearly():
    async def test(client, workers):
        task, rank = await to_decode_rank(client, workers, "r")
        rank.report(kv_received=["r"])  # the prefill worker's staged copy is gone
        await until(lambda: not client._requests["r"].kv_pending, "KV received")
        rank.send(WorkerFailed(rank.worker_id, "Traceback ...\nRuntimeError: boom"))
        result = await asyncio.wait_for(task, 20)
        assert isinstance(result["error"], EngineDeadError), result
        assert f"{rank.worker_id} was lost" in str(result["error"]), result["error"]
        assert client.health.num_retried == 0 and result["tokens"] == [5]
    run_ep_front(test)


def test_a_retry_that_finds_the_kv_gone_fails_naming_the_lost_group():
    """The rank may have pulled the KV (the prefill worker's copy is gone) without the front
    hearing of it before the rank died: the retry's pull fails, and the client's error says
    why (the group loss), not only that a KV transfer failed."""
    async def test(client, workers):
        task, rank = await to_decode_rank(client, workers, "r")
        lost = group_of(rank.worker_id)
        rank.send(WorkerFailed(rank.worker_id, "Traceback ...\nRuntimeError: boom"))
        await until(lambda: client.placements["r"][1] not in lost, "decode routed elsewhere",
                    timeout=20)
        again = workers[client.placements["r"][1]]
        await again.expect(DecodeRequest)
        again.report(errors=[RequestError("r", "KV transfer failed: not staged (expired, "
                                               "aborted or unknown)")])
        result = await asyncio.wait_for(task, 20)
        error = str(result["error"])
        assert isinstance(result["error"], EngineDeadError), result
        assert f"decode group {int(lost[0][1]) // 2} lost: {rank.worker_id}" in error, error
        assert f"retried on {again.worker_id}" in error and "not staged" in error, error
        assert client.health.num_retried == 1 and result["tokens"] == [5]
    run_ep_front(test)


def test_decode_group_eplb_reports_are_on_metrics_per_group():
    async def test(client, workers):
        client.model_name, client.redundant_expert_bytes = "m", 4096
        registry = CollectorRegistry()
        client.register_metrics(registry)
        stats = EPLBStats(step=6, balancedness_before=[0.5, 0.6], balancedness_after=[0.9, 0.95],
                          num_moved_slots=3, moved_bytes=1000, duration_s=0.25,
                          redundant_expert_bytes=4096, num_rebalances=1)
        workers["d2"].send(WorkerEPLBStats("d2", stats))  # rank 0 of group 1
        await until(lambda: client.decode_group_eplb[1].num_rebalances == 1, "EPLB recorded")
        text = generate_latest(registry).decode()
        for line in ('deepinfer:eplb_balancedness{dp_group="1",layer="1",model_name="m",'
                     'phase="after"} 0.95',
                     'deepinfer:eplb_balancedness{dp_group="1",layer="0",model_name="m",'
                     'phase="before"} 0.5',
                     'deepinfer:eplb_rebalances_total{dp_group="1",model_name="m"} 1.0',
                     'deepinfer:eplb_rebalances_total{dp_group="0",model_name="m"} 0.0',
                     'deepinfer:eplb_moved_expert_bytes_total{dp_group="1",model_name="m"} 1000.0',
                     'deepinfer:eplb_last_rebalance_seconds{dp_group="1",model_name="m"} 0.25',
                     'deepinfer:eplb_redundant_expert_bytes{dp_group="0",model_name="m"} 4096.0'):
            assert line in text, (line, text)
    run_ep_front(test)
