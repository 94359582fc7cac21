"""Shared-store prefill routing vs cache affinity, on skewed system prompts and a multi-turn
conversation replay.

Workloads
  skewed    8 system prompts of 512 tokens with Zipf popularity (s = --zipf), each request
            one of them + a unique 32-96-token suffix, 16 output tokens, Poisson arrivals
  convo     multi-turn conversations: each turn's prompt is the previous prompt + the previous
            answer + a new 32-96-token user message; turns 2-4 s apart

Modes
  sim   the cluster simulator (deepinfer/sim: the engine's own Scheduler, KVCacheManager and
        routers, step times from the measured CPU profile) at --prefill/--decode workers,
        each with a dedicated core. Policies:
          cache-affinity          consistent hash of the first 4 blocks (store as before:
                                  blocks published at request end, blocking loads)
          cache-affinity+store    the same router with the new store path below
          least-compute (old)     cache-agnostic, store as before
          least-compute+store     prefix-aware least-compute: in-flight prefixes reused or
                                  awaited, blocks published per chunk, store reads while the
                                  request queues, load or recompute by cost
  real  the real cluster on this machine (P prefill + D decode processes, --cpu-affinity),
        usage.cached_tokens from the front, device/store split from worker counters. The
        policies alternate over --rounds rounds (A B, then B A, ...), each run on a fresh
        cluster and an empty store, so a shared machine's load drifts over both alike; the
        JSON has every run and the pooled figures per policy.

    .venv/bin/python benchmarks/store_routing_bench.py sim --prefill 8 --decode 8 --rate 40
    .venv/bin/python benchmarks/store_routing_bench.py real --prefill 2 --decode 1 \
        --workload skewed --rate 0.4 --num-requests 24 --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deepinfer.bench.workloads import BenchRequest  # noqa: E402
from deepinfer.core.cost_model import ChunkShape, plan_store_load  # noqa: E402
from deepinfer.core.prefix_hash import hash_request_blocks  # noqa: E402
from deepinfer.routing import NoWorkerAvailable, RoutingRequest, build_prefill_router  # noqa: E402
from deepinfer.sim.cluster_spec import cluster_from_dict  # noqa: E402
from deepinfer.sim.simulator import ClusterSimulator  # noqa: E402

PROFILE = os.path.join(ROOT, "benchmarks/results/cost_profile_smollm2_bf16_cpu_1thread.json")
TOKENS = (1000, 30000)
AWAIT_POLL_S = 0.005


# --- workloads ------------------------------------------------------------------------------
def skewed_workload(num: int, rate: float, seed: int, zipf: float = 1.1, num_prompts: int = 8,
                    prefix_len: int = 512, output_len: int = 16) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(*TOKENS, prefix_len).tolist() for _ in range(num_prompts)]
    weights = 1.0 / np.arange(1, num_prompts + 1) ** zipf
    groups = rng.choice(num_prompts, size=num, p=weights / weights.sum())
    arrivals = np.cumsum(np.r_[0.0, rng.exponential(1.0 / rate, num - 1)])
    return [BenchRequest(prefixes[g] + rng.integers(*TOKENS, int(rng.integers(32, 97))).tolist(),
                         output_len, float(t)) for g, t in zip(groups, arrivals)]


def conversation_workload(num_convs: int, turns: int, rate: float, seed: int,
                          system_len: int = 256, output_len: int = 16) -> list[BenchRequest]:
    """Conversations start as a Poisson process at `rate` per second; each shares one of 4
    system prompts; answers are random tokens (the replay fixes them, as a trace would)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(*TOKENS, system_len).tolist() for _ in range(4)]
    starts = np.cumsum(np.r_[0.0, rng.exponential(1.0 / rate, num_convs - 1)])
    out = []
    for c, start in enumerate(starts):
        history = list(systems[c % 4])
        t = float(start)
        for _ in range(turns):
            history += rng.integers(*TOKENS, int(rng.integers(32, 97))).tolist()
            out.append(BenchRequest(list(history), output_len, t))
            history += rng.integers(*TOKENS, output_len).tolist()  # the answer
            t += float(rng.uniform(2.0, 4.0))
    return sorted(out, key=lambda r: r.arrival_time_s)


# --- simulator with the new store path --------------------------------------------------------
class StoreRoutingSimulator(ClusterSimulator):
    """The base simulator plus what `cluster/prefill_worker.py` now does: full block hashes
    to the router, in-flight prefixes reused or awaited, blocks published per chunk, store
    reads while the request queues (not stalling the worker), load or recompute by cost."""

    def __init__(self, cluster, *, new_store_path: bool, **kwargs) -> None:
        super().__init__(cluster, **kwargs)
        self.new = new_store_path
        self._plans: dict[str, object] = {}
        self._published: dict[str, int] = {}
        self.num_loads_skipped = 0
        self.num_awaited = 0

    def _on_arrival(self, record) -> None:
        pool = self._entry_pool()
        kv = pool[0].scheduler.kv
        hashes = hash_request_blocks(record.prompt_token_ids, kv.block_size, kv.hash_salt)
        record.block_hashes = hashes
        routing = RoutingRequest(record.request_id, record.prompt_len,
                                 hashes if self.new else hashes[:4])
        try:
            worker = self.workers[self.prefill_router.route(
                routing, [w.last_load for w in pool], self.now)]
        except (NoWorkerAvailable, ValueError) as e:
            record.error = str(e)
            return
        plan = self.prefill_router.take_prefix_plan(record.request_id)
        if plan is not None:
            self._plans[record.request_id] = plan
            self.num_awaited += plan.await_worker is not None  # a prefix in flight elsewhere
        record.prefill_worker = worker.worker_id
        self._deliver(worker, record)

    def _admit_new(self, worker, record) -> None:
        if not (self.new and self.store is not None and worker.role == "prefill"):
            return super()._admit_new(worker, record)
        kv = worker.scheduler.kv
        bs = kv.block_size
        usable = record.block_hashes[:(record.prompt_len - 1) // bs]
        num_device = 0
        while num_device < len(usable) and kv.pool.is_cached(usable[num_device]):
            num_device += 1
        plan = self._plans.get(record.request_id)
        num_stored = num_device
        while num_stored < len(usable) and usable[num_stored] in self.store._blocks:
            num_stored += 1
        if plan is not None and num_stored < min(plan.num_await_blocks, len(usable)) \
                and self.now < plan.await_until:
            self._at(self.now + AWAIT_POLL_S, self._retry_admit, worker, record)  # await
            return
        self._plans.pop(record.request_id, None)
        link = self.cluster.prefix_store.link
        per_token = worker.step_model.kv_bytes_per_token
        load = plan_store_load(record.prompt_len, num_device * bs, num_stored - num_device, bs,
                               lambda k: link.seconds(k * bs * per_token),
                               lambda new, ctx: worker.step_model.step_time_s(
                                   [ChunkShape(ctx, max(1, new))]))
        if load.num_load_blocks == 0 and num_stored > num_device:
            self.num_loads_skipped += 1
        hashes = usable[:num_device + load.num_load_blocks]
        if load.num_load_blocks == 0:  # nothing to read: admitted now, as the base does
            self._finish_admit(worker, record, hashes, kick=False)
        else:  # read while it queues; the worker keeps stepping meanwhile
            self._at(self.now + load.load_s, self._finish_admit, worker, record, hashes)

    def _retry_admit(self, worker, record) -> None:
        self._admit_new(worker, record)
        if not worker.busy:
            self._start_step(worker)

    def _finish_admit(self, worker, record, hashes, kick: bool = True) -> None:
        kv = worker.scheduler.kv
        got = kv.load_prefix_blocks(hashes, self.store.get, lambda block_id, payload: None)
        record.num_store_tokens = got.num_loaded_blocks * kv.block_size
        self._add_request(worker, record)
        if kick:
            self._publish(worker)
            if not worker.busy:
                self._start_step(worker)

    def _publish(self, worker) -> None:
        """Prefill workers report their store read rate (the real ones measure it)."""
        if getattr(self, "new", False) and self.store is not None and worker.role == "prefill":
            link = self.cluster.prefix_store.link
            per_token = link.seconds(1 << 20) / (1 << 20) * worker.step_model.kv_bytes_per_token
            worker.last_load = dataclasses.replace(worker.load(self.now),
                                                   store_load_s_per_token=per_token)
            self.prefill_router.on_load_report(worker.last_load)
            return
        super()._publish(worker)

    def _apply(self, worker, output, result) -> None:
        super()._apply(worker, output, result)
        if not (self.new and self.store is not None and worker.role == "prefill"):
            return
        bs = worker.scheduler.kv.block_size
        link = self.cluster.prefix_store.link
        for s in output.scheduled:
            request = worker.scheduler.requests.get(s.request_id)
            record = self.requests[s.request_id]
            if request is None or not record.block_hashes:
                continue
            done = self._published.get(s.request_id, 0)
            full = min(request.num_computed_tokens // bs, record.prompt_len // bs)
            if full > done:
                num_bytes = (full - done) * bs * worker.step_model.kv_bytes_per_token
                self._at(self.now + link.seconds(num_bytes), self.store.put_many,
                         list(record.block_hashes[done:full]))
                self._published[s.request_id] = full



class PlanLog:
    """Per request: where the router sent it and the prefix reuse it planned there (device
    blocks + blocks to load or await; None for policies without a plan), to set against the
    hit the worker realised. Wraps the router's `on_routed`."""

    def __init__(self, router, block_size: int = 16) -> None:
        self.planned: dict[str, tuple[str, int | None]] = {}
        routed = router.on_routed

        def on_routed(request, worker_id, now):
            routed(request, worker_id, now)
            plan = getattr(router, "last_plan", None)
            reuse = None if plan is None else (plan.num_local_blocks
                                               + plan.num_load_blocks) * block_size
            self.planned[request.request_id] = (worker_id, reuse)

        router.on_routed = on_routed

    def rows(self, realised: list[tuple[str, float, int, int | None, float | None]]
             ) -> list[dict]:
        """`realised`: (request id, arrival s, prompt tokens, cached tokens, TTFT s)."""
        out = []
        for rid, arrival, prompt_len, cached, ttft in realised:
            worker, planned = self.planned.get(rid, (None, None))
            out.append({"id": rid, "arrival_s": round(arrival, 4), "prompt_tokens": prompt_len,
                        "worker": worker, "planned_reuse_tokens": planned,
                        "cached_tokens": cached, "ttft_s": ttft})
        return out


def plan_shortfall(requests: list[dict]) -> dict | None:
    """Requests that reused fewer prompt tokens than their routing plan expected (None: the
    policy makes no plans)."""
    if all(r["planned_reuse_tokens"] is None for r in requests):
        return None
    short = [r for r in requests if r["planned_reuse_tokens"] is not None
             and r["cached_tokens"] is not None and r["cached_tokens"] < r["planned_reuse_tokens"]]
    return {"num_requests": len(short),
            "tokens": sum(r["planned_reuse_tokens"] - r["cached_tokens"] for r in short)}


def compare_to_affinity(rows: list[dict]) -> None:
    """Per request, against cache affinity: how many hit less (and by how many tokens)."""
    base = next((r for r in rows if r["policy"] == "cache-affinity"), None)
    if base is None:
        return
    for row in rows:
        lost = [b["cached_tokens"] - x["cached_tokens"]
                for b, x in zip(base["requests"], row["requests"])
                if (x["cached_tokens"] or 0) < (b["cached_tokens"] or 0)]
        row["fewer_hits_than_affinity"] = {"num_requests": len(lost), "tokens": sum(lost)}


def sim_cluster(num_prefill: int, num_decode: int, policy: str, store_gb_s: float,
                store_latency_ms: float, store: bool = True):
    return cluster_from_dict({
        "cost": {"profile": PROFILE},
        "engine": {"num_kv_blocks": 8192, "block_size": 16, "max_num_batched_tokens": 2048},
        "pools": {"prefill": {"workers": num_prefill}, "decode": {"workers": num_decode}},
        "routers": {"prefill": policy, "decode": "balanced"},
        "prefix_store": {"capacity_blocks": 200000, "bandwidth_gb_s": store_gb_s,
                         "latency_ms": store_latency_ms} if store else "none",
        "kv_transfer": {"bandwidth_gb_s": 1.0, "latency_ms": 1.0}})


SIM_POLICIES = {  # label -> (router, router options, new store path)
    "cache-affinity": ("cache-affinity", {}, False),
    "cache-affinity+store": ("cache-affinity", {}, True),
    "least-compute (old)": ("least-compute", {"track_prefixes": False}, False),
    "least-compute+store": ("least-compute", {}, True),
    "least-compute (no store)": ("least-compute", {}, False),
}


def run_sim(label: str, requests: list[BenchRequest], args) -> dict:
    router, options, new = SIM_POLICIES[label]
    cluster = sim_cluster(args.prefill, args.decode, router, args.store_gb_s,
                          args.store_latency_ms, store="no store" not in label)
    sim = StoreRoutingSimulator(cluster, new_store_path=new)
    sim.prefill_router = build_prefill_router(router, **options)
    log = PlanLog(sim.prefill_router)
    records = sim.run(requests)
    results = [r.to_result() for r in records]
    row = summarize(label, results,
                    store_tokens=sum(r.num_store_tokens for r in records if r.error is None),
                    prefill_tokens=_prefill_tokens_by_worker(records))
    row.update(loads_skipped=sim.num_loads_skipped, awaited=sim.num_awaited)
    row["requests"] = log.rows([(r.request_id, r.arrival_s, r.prompt_len, r.num_cached_tokens,
                                 x.ttft_s) for r, x in zip(records, results)])
    row["plan_shortfall"] = plan_shortfall(row["requests"])
    return row


def _prefill_tokens_by_worker(records) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.prefill_worker is not None and r.num_cached_tokens is not None:
            computed = r.prompt_len - r.num_cached_tokens
            out[r.prefill_worker] = out.get(r.prefill_worker, 0) + computed
    return out


# --- summary ----------------------------------------------------------------------------------
def summarize(label: str, results, store_tokens: int, prefill_tokens: dict[str, int]) -> dict:
    ok = [r for r in results if r.success]
    ttft = np.array([r.ttft_s for r in ok]) if ok else np.array([math.nan])
    prompt = sum(r.prompt_len for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    work = np.array(list(prefill_tokens.values()) or [0])
    return {
        "policy": label, "num_ok": len(ok), "num_failed": len(results) - len(ok),
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "ttft_mean_s": float(ttft.mean()),
        "hit_rate": cached / prompt if prompt else 0.0,
        "hit_tokens": cached, "store_hit_tokens": store_tokens,
        "device_hit_tokens": cached - store_tokens, "prompt_tokens": prompt,
        "prefill_tokens_by_worker": dict(sorted(prefill_tokens.items())),
        "prefill_max_over_mean": float(work.max() / work.mean()) if work.mean() else 0.0,
    }


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'policy':24} {'TTFT p50':>9} {'TTFT p99':>9} {'hit %':>6} {'device':>7} "
          f"{'store':>7} {'max/mean':>8} {'short of plan':>14} {'< affinity':>11}")
    for r in rows:
        short = r.get("plan_shortfall")
        short = f"{short['num_requests']} / {short['tokens']}" if short else "-"
        worse = r.get("fewer_hits_than_affinity")
        worse = f"{worse['num_requests']} / {worse['tokens']}" if worse else "-"
        print(f"{r['policy']:24} {r['ttft_p50_s']:9.3f} {r['ttft_p99_s']:9.3f} "
              f"{100 * r['hit_rate']:6.1f} {r['device_hit_tokens']:7d} "
              f"{r['store_hit_tokens']:7d} {r['prefill_max_over_mean']:8.2f} {short:>14} "
              f"{worse:>11}")


# --- the real cluster -------------------------------------------------------------------------
async def run_real(label: str, requests: list[BenchRequest], args) -> dict:
    from deepinfer.cluster.cluster_config import ClusterConfig
    from deepinfer.clients.factory import make_client
    from deepinfer.engine.engine_config import EngineConfig
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.bench.latency_stats import RequestResult

    router, options, _ = {"cache-affinity": ("cache-affinity", {}, True),
                          "least-compute+store": ("least-compute", {}, True),
                          "least-compute (no prefix tracking)":
                              ("least-compute", {"track_prefixes": False}, True)}[label]
    store_dir = os.path.join(args.store_root, label.replace(" ", "_").replace("+", "_"))
    shutil.rmtree(store_dir, ignore_errors=True)  # every run starts from an empty store
    os.makedirs(store_dir)
    engine = EngineConfig(dtype=args.dtype, num_kv_blocks=2048, num_threads=1, seed=0)
    client = make_client(engine, cluster=ClusterConfig(
        num_prefill_workers=args.prefill, num_decode_workers=args.decode,
        kv_store_url=f"fs://{store_dir}", prefill_router=router, cpu_affinity=True,
        heartbeat_timeout_s=30.0, loop_stall_timeout_s=120.0, stall_timeout_s=600.0))
    client.prefill_router = build_prefill_router(router, **options)
    log = PlanLog(client.prefill_router, engine.block_size)
    await client.start()
    results: list = []
    by_index: dict[int, object] = {}

    async def one(i: int, req: BenchRequest, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + req.arrival_time_s - time.monotonic()))
        start = time.monotonic()
        result = RequestResult(success=False, prompt_len=len(req.prompt_token_ids),
                               output_len=0, start_s=start - t0)
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
        try:
            async for delta in client.generate(f"r{i}", req.prompt_token_ids, params):
                n = sum(len(c.token_ids) for c in delta.choices)
                if n and result.ttft_s is None:
                    result.ttft_s = time.monotonic() - start
                result.output_len += n
                result.cached_tokens = delta.num_cached_tokens
            result.success = True
        except Exception as exc:  # recorded
            result.error = str(exc)
        results.append(result)
        by_index[i] = result

    try:
        t0 = time.monotonic()
        await asyncio.gather(*[one(i, r, t0) for i, r in enumerate(requests)])
        await asyncio.sleep(1.0)  # last reports
        counters = {wid: h.counters for wid, h in client.workers.items()
                    if h.role == "prefill"}
        routed = dict(sorted(client.prefill_router.num_routed.items()))
        suspensions = client.health.num_suspended
    finally:
        await client.shutdown()
    row = summarize(label, results, store_tokens=sum(c.store_hit_tokens + c.host_hit_tokens
                                                     for c in counters.values()),
                    prefill_tokens={w: c.prefix_query_tokens - c.device_hit_tokens
                                    - c.store_hit_tokens - c.host_hit_tokens
                                    for w, c in counters.items()})
    row["worker_counters"] = {w: {"device": c.device_hit_tokens, "store": c.store_hit_tokens,
                                  "host": c.host_hit_tokens, "query": c.prefix_query_tokens,
                                  "published_early": c.store_blocks_published,
                                  "loads_skipped": c.store_loads_skipped,
                                  "read_timeouts": getattr(c, "store_read_timeouts", 0),
                                  "await_tokens": c.store_await_tokens}
                              for w, c in counters.items()}
    row["routed"], row["worker_suspensions"] = routed, suspensions
    row["requests"] = log.rows([(f"r{i}", req.arrival_time_s, len(req.prompt_token_ids),
                                 by_index[i].cached_tokens, by_index[i].ttft_s)
                                for i, req in enumerate(requests)])
    row["plan_shortfall"] = plan_shortfall(row["requests"])
    row["ttft_s"] = [r.ttft_s for r in results if r.success]
    row["load_avg_1m_after"] = os.getloadavg()[0]
    return row


def pool_rows(label: str, rows: list[dict]) -> dict:
    """One policy's runs together: percentiles over every request, tokens summed."""
    ttft = np.array([t for r in rows for t in r["ttft_s"]] or [math.nan])
    prompt = sum(r["prompt_tokens"] for r in rows)
    by_worker: dict[str, int] = {}
    for r in rows:
        for w, n in r["prefill_tokens_by_worker"].items():
            by_worker[w] = by_worker.get(w, 0) + n
    work = np.array(list(by_worker.values()) or [0])
    out = {"policy": f"{label} (pooled)", "num_runs": len(rows),
           "num_ok": sum(r["num_ok"] for r in rows),
           "num_failed": sum(r["num_failed"] for r in rows),
           "ttft_p50_s": float(np.percentile(ttft, 50)),
           "ttft_p99_s": float(np.percentile(ttft, 99)), "ttft_mean_s": float(ttft.mean()),
           "prompt_tokens": prompt, "prefill_tokens_by_worker": dict(sorted(by_worker.items())),
           "prefill_max_over_mean": float(work.max() / work.mean()) if work.mean() else 0.0}
    for key in ("hit_tokens", "store_hit_tokens", "device_hit_tokens"):
        out[key] = sum(r[key] for r in rows)
    out["hit_rate"] = out["hit_tokens"] / prompt if prompt else 0.0
    return out


# --- main -------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("sim", "real"))
    p.add_argument("--workload", choices=("skewed", "convo", "both"), default="both")
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--rate", type=float, default=None,
                   help="requests/s (skewed) or conversations/s (convo)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--store-gb-s", type=float, default=2.0, help="sim: store bandwidth")
    p.add_argument("--store-latency-ms", type=float, default=0.5, help="sim: store latency")
    p.add_argument("--policies", default=None, help="comma-separated subset")
    p.add_argument("--dtype", default="bfloat16", help="real: worker dtype")
    p.add_argument("--store-root", default="/tmp/deepinfer-store-routing-bench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2,
                   help="real: runs per policy, alternating the order (A B, B A, ...)")
    p.add_argument("--per-request", action="store_true",
                   help="sim: keep the per-request log in the JSON (real runs always do)")
    p.add_argument("--output", default=None)
    args = p.parse_args()

    real = args.mode == "real"
    rate = args.rate or (1.0 if real else 40.0)
    num = args.num_requests or (40 if real else 400)
    workloads = {}
    if args.workload in ("skewed", "both"):
        workloads["skewed"] = skewed_workload(num, rate, args.seed, args.zipf)
    if args.workload in ("convo", "both"):
        convs = max(1, num // 5)
        workloads["convo"] = conversation_workload(convs, 5, rate / 5, args.seed)
    labels = (["cache-affinity", "least-compute+store"] if real else list(SIM_POLICIES))
    if args.policies:
        labels = [s.strip() for s in args.policies.split(",")]
    out = {"mode": args.mode, "prefill_workers": args.prefill, "decode_workers": args.decode,
           "rate": rate, "num_requests": num, "zipf": args.zipf, "seed": args.seed,
           "command": " ".join(sys.argv), "runs": {}}
    if not real:
        out.update(store_gb_s=args.store_gb_s, store_latency_ms=args.store_latency_ms,
                   cost_profile=os.path.relpath(PROFILE, ROOT))
    if real:
        out["rounds"] = args.rounds
        out["cpus"] = os.cpu_count()
    for name, requests in workloads.items():
        rows = []
        if real:
            for r in range(args.rounds):
                for label in (labels if r % 2 == 0 else labels[::-1]):
                    row = asyncio.run(run_real(label, requests, args))
                    row["round"] = r
                    rows.append(row)
                    print_table(f"{name} round {r}", [row])
                compare_to_affinity([x for x in rows if x.get("round") == r])
            rows += [pool_rows(label, [x for x in rows if x["policy"] == label])
                     for label in labels]
        else:
            rows = [run_sim(label, requests, args) for label in labels]
            compare_to_affinity(rows)
            if not args.per_request:
                for row in rows:
                    del row["requests"]  # 400 rows per policy: only on request
        out["runs"][name] = rows
        print_table(f"{name}: {len(requests)} requests, {args.prefill}P/{args.decode}D "
                    f"({args.mode})", rows)
    path = args.output or os.path.join(
        ROOT, f"benchmarks/results/store_routing_{args.mode}_{args.prefill}p{args.decode}d.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
