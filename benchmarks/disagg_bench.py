"""Disaggregated serving benchmark: P=2 prefill + D=2 decode workers (one thread each).

Replays a shrunk Mooncake conversation trace and a shared-prefix workload through the
`DisaggClient` (real worker processes, TCP) once per routing policy, and prints / writes JSON:
prefill policies -> prefix hit rate by tier (device / shared store), TTFT p50/p99;
decode policies  -> TPOT p99, max/mean of KV tokens per decode worker (sampled every 50 ms).

    .venv/bin/python benchmarks/disagg_bench.py --num-prompts 40 --out disagg_bench.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import numpy as np

from deepinfer.bench.traces import ShrinkConfig
from deepinfer.bench.workloads import WorkloadConfig, build_workload
from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.clients.disagg import DisaggClient
from deepinfer.clients.factory import make_client
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.sampling_params import SamplingParams

from pathlib import Path

# The public traces live in ../shared beside the checkout (see its README).
TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake"
            / "conversation_trace.jsonl")


def workloads(num_prompts: int) -> dict:
    shrink = ShrinkConfig(length_scale=0.05, max_input_len=768, max_output_len=48)
    return {
        "mooncake": build_workload(WorkloadConfig(kind=f"trace:{TRACE}", num_prompts=num_prompts,
                                                  time_scale=0.05, shrink=shrink)),
        "shared-prefix": build_workload(WorkloadConfig(
            kind="shared-prefix", num_prompts=num_prompts, input_len=64, output_len=32,
            num_groups=4, shared_prefix_len=256, request_rate=4.0)),
    }


async def replay(client: DisaggClient, requests) -> dict:
    ttft, tpot, kv_samples = [], [], []
    start = time.monotonic()

    async def one(i, req):
        await asyncio.sleep(max(0.0, start + req.arrival_time_s - time.monotonic()))
        t0, first, n = time.monotonic(), None, 0
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
        async for delta in client.generate(f"b{i}-{t0}", req.prompt_token_ids, params):
            n += len(delta.choices[0].token_ids)
            if first is None and n:
                first = time.monotonic()
        ttft.append(first - t0)
        if n > 1:
            tpot.append((time.monotonic() - first) / (n - 1))

    async def sample_kv():
        while True:
            kv_samples.append([h.last_report.kv_tokens for h in client.workers.values()
                               if h.role == "decode" and h.last_report])
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample_kv())
    before = {w: h.counters for w, h in client.workers.items()}
    await asyncio.gather(*[one(i, r) for i, r in enumerate(requests)])
    sampler.cancel()
    await asyncio.sleep(0.5)  # last reports
    pre = [w for w in client.workers if w.startswith("prefill")]
    q = sum(client.workers[w].counters.prefix_query_tokens - before[w].prefix_query_tokens for w in pre)
    dev = sum(client.workers[w].counters.device_hit_tokens - before[w].device_hit_tokens for w in pre)
    sto = sum(client.workers[w].counters.store_hit_tokens - before[w].store_hit_tokens for w in pre)
    busy = [s for s in kv_samples if sum(s) > 0]
    imbalance = float(np.mean([max(s) / (sum(s) / len(s)) for s in busy])) if busy else 1.0
    return {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tpot_p99_s": float(np.percentile(tpot, 99)) if tpot else None,
            "hit_rate_device": dev / q if q else 0.0, "hit_rate_store": sto / q if q else 0.0,
            "kv_max_over_mean": imbalance, "num_requests": len(requests)}


async def run_one(prefill_policy: str, decode_policy: str, workload) -> dict:
    engine = EngineConfig(dtype="bfloat16", num_kv_blocks=1024, num_threads=1)
    store = f"fs://{tempfile.mkdtemp(prefix='disagg-bench-')}"  # fresh store per run
    client = make_client(engine, cluster=ClusterConfig(2, 2, kv_store_url=store,
                                                       prefill_router=prefill_policy,
                                                       decode_router=decode_policy,
                                                       heartbeat_timeout_s=10.0))
    await client.start()
    try:
        return await replay(client, workload.requests)
    finally:
        await client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--prefill-policies", default="least-compute,round-robin,cache-affinity")
    parser.add_argument("--decode-policies", default="balanced,round-robin,least-kv")
    parser.add_argument("--out", default="disagg_bench.json")
    args = parser.parse_args()
    results = []
    for name, workload in workloads(args.num_prompts).items():
        runs = [(p, "balanced") for p in args.prefill_policies.split(",")]
        runs += [("least-compute", d) for d in args.decode_policies.split(",") if d != "balanced"]
        for prefill_policy, decode_policy in runs:
            row = {"workload": name, "prefill": prefill_policy, "decode": decode_policy,
                   **asyncio.run(run_one(prefill_policy, decode_policy, workload))}
            print(json.dumps(row), flush=True)
            results.append(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
