"""Chaos benchmark: a P=2/D=2 disaggregated cluster under steady open-loop load while a driver
SIGKILLs and SIGSTOPs random workers of each role and corrupts shared-store blocks.

    load:   Poisson arrivals, greedy, short prompts sharing a few 2-block prefixes (so prefill
            workers read each other's blocks from the `fs` store in a temp dir)
    faults: round robin over kill-prefill, stop-decode, corrupt-store, kill-decode,
            stop-prefill, corrupt-store ... every --fault-interval-s; a role is only hit while
            all of its workers are routable (never the last one on purpose). A SIGSTOP lasts
            1 s to --max-stop-s: short ones go unnoticed, longer ones are suspended from
            routing (missed heartbeats) and resumed, the longest are killed and restarted

Reports requests sent / completed / failed with an error / hung (client timeout: must be 0),
completed outputs equal to the offline `deepinfer.LLM` reference (fp32 greedy, computed first),
KV blocks in use per worker after the load drains (must be 0), restarts, and per fault the time
from the fault until the worker was routable again. Prints a table; writes JSON.

    .venv/bin/python benchmarks/chaos.py                       # ~4 min of load
    .venv/bin/python benchmarks/chaos.py --duration-s 60 --out /tmp/chaos.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.clients.disagg import DisaggClient
from deepinfer.clients.factory import make_client
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "chaos.json"
FAULT_CYCLE = ("kill:prefill", "stop:decode", "corrupt", "kill:decode", "stop:prefill", "corrupt")


@dataclass
class Outcome:
    request_id: str
    sent_at: float
    status: str = "pending"  # completed | failed | hung
    latency_s: float = 0.0
    equal_to_reference: bool | None = None
    error: str | None = None


@dataclass
class Fault:
    kind: str  # kill | stop | corrupt
    at_s: float  # since the load started
    worker_id: str | None = None
    role: str | None = None
    detail: str = ""
    left_routing: bool | None = None  # taken out of routing (lost, or suspended as hung)
    lost: bool | None = None  # declared lost (killed and restarted)
    recovery_s: float | None = None  # fault -> routable again (if it left routing)


def build_prompts(num: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random-token prompts: one of 8 shared 32-token (2-block) prefixes + 4..28 own tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab_size) for _ in range(32)] for _ in range(8)]
    return [rng.choice(prefixes) + [rng.randrange(100, vocab_size)
                                    for _ in range(rng.randint(4, 28))] for _ in range(num)]


def prompts_and_references(engine: EngineConfig, num: int, seed: int, params: SamplingParams,
                           ) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts, and their greedy outputs from the offline engine (same dtype and seed)."""
    from deepinfer import LLM

    llm = LLM(model=engine.model, dtype=engine.dtype, num_kv_blocks=1024,
              num_threads=engine.num_threads, seed=engine.seed)
    prompts = build_prompts(num, llm.engine.model_config.vocab_size, seed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


class ChaosRun:
    def __init__(self, args, client: DisaggClient, store_dir: Path, prompts, references,
                 params: SamplingParams) -> None:
        self.args = args
        self.client = client
        self.store_dir = store_dir
        self.prompts = prompts
        self.references = references
        self.params = params
        self.rng = random.Random(args.seed + 1)
        self.outcomes: list[Outcome] = []
        self.faults: list[Fault] = []
        self.start = 0.0
        self._background: list[asyncio.Task] = []

    # --- load --------------------------------------------------------------------------------
    async def one_request(self, index: int) -> None:
        out = Outcome(f"chaos-{index}", time.monotonic() - self.start)
        self.outcomes.append(out)
        tokens: list[int] = []

        async def consume() -> None:
            async for delta in self.client.generate(out.request_id, self.prompts[index],
                                                    self.params):
                tokens.extend(delta.choices[0].token_ids)

        t0 = time.monotonic()
        try:
            await asyncio.wait_for(consume(), self.args.client_timeout_s)
            out.status, out.equal_to_reference = "completed", tokens == self.references[index]
        except asyncio.TimeoutError:
            out.status, out.error = "hung", f"no answer within {self.args.client_timeout_s} s"
        except Exception as exc:  # every other outcome is a failure with its message
            out.status, out.error = "failed", f"{type(exc).__name__}: {exc}"
        out.latency_s = time.monotonic() - t0

    async def load(self) -> None:
        rng = random.Random(self.args.seed)
        tasks, index, next_at = [], 0, 0.0
        while next_at < self.args.duration_s and index < len(self.prompts):
            await asyncio.sleep(max(0.0, self.start + next_at - time.monotonic()))
            tasks.append(asyncio.create_task(self.one_request(index)))
            index += 1
            next_at += rng.expovariate(self.args.rate)
        await asyncio.gather(*tasks)

    # --- faults ------------------------------------------------------------------------------
    def _victim(self, role: str) -> str | None:
        """A random worker of `role`, only while every worker of the role is routable."""
        ids = [w for w, h in self.client.workers.items() if h.role == role]
        if not all(self.client.workers[w].alive for w in ids):
            return None
        return self.rng.choice(ids)

    async def faults_loop(self) -> None:
        cycle = 0
        while True:
            await asyncio.sleep(self.args.fault_interval_s)
            if time.monotonic() - self.start > self.args.duration_s - self.args.fault_interval_s:
                return  # leave the last interval for recovery
            action = FAULT_CYCLE[cycle % len(FAULT_CYCLE)]
            cycle += 1
            if action == "corrupt":
                self.corrupt_store()
                continue
            kind, role = action.split(":")
            worker_id = self._victim(role)
            if worker_id is None:
                self.faults.append(Fault(kind, self._now(), role=role,
                                         detail="skipped: a worker of the role is down"))
                continue
            fault = Fault(kind, self._now(), worker_id, role)
            self.faults.append(fault)
            self._background.append(asyncio.create_task(self.inject(fault)))

    async def inject(self, fault: Fault) -> None:
        """Apply the fault, then watch the worker (every 0.1 s) until it is routable again
        with a running process: `recovery_s` is the time from the fault until then, for faults
        that took it out of routing."""
        pid = self.client.workers[fault.worker_id].proc.pid
        t0 = time.monotonic()
        cont_at = None
        if fault.kind == "kill":
            os.kill(pid, signal.SIGKILL)
            fault.detail = f"SIGKILL pid {pid}"
        else:
            pause = self.rng.uniform(1.0, self.args.max_stop_s)
            os.kill(pid, signal.SIGSTOP)
            cont_at = t0 + pause
            fault.detail = f"SIGSTOP pid {pid} for {pause:.1f} s"
        fault.left_routing = fault.lost = False
        while time.monotonic() < t0 + self.args.recovery_timeout_s:
            now = time.monotonic()
            if cont_at is not None and now >= cont_at:
                cont_at = None
                with contextlib.suppress(ProcessLookupError):  # killed as hung meanwhile
                    os.kill(pid, signal.SIGCONT)
            handle = self.client.workers[fault.worker_id]
            fault.lost = fault.lost or self._outage(fault.worker_id, t0) is not None
            if not handle.alive:
                fault.left_routing = True
            elif handle.proc.pid != pid or (fault.kind == "stop" and cont_at is None
                                            and self._proc_running(pid)):
                if fault.left_routing:
                    fault.recovery_s = now - t0
                return
            await asyncio.sleep(0.1)

    def _outage(self, worker_id: str, since: float):
        for record in reversed(self.client.supervisor.records):
            if record.worker_id == worker_id and record.lost_at >= since:
                return record
        return None

    @staticmethod
    def _proc_running(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        except (OSError, IndexError):
            return False
        return state not in ("T", "t", "Z")

    def corrupt_store(self) -> None:
        files = sorted(self.store_dir.rglob("*.kvb"))
        picked = self.rng.sample(files, min(self.args.corrupt_blocks, len(files)))
        for path in picked:
            try:
                data = bytearray(path.read_bytes())
                offset = self.rng.randrange(len(data))  # header or payload
                for i in range(offset, min(len(data), offset + 8)):
                    data[i] = self.rng.randrange(256)
                path.write_bytes(bytes(data))
            except OSError:
                pass  # evicted meanwhile
        self.faults.append(Fault("corrupt", self._now(), detail=f"{len(picked)} of "
                                 f"{len(files)} store blocks overwritten"))

    def _now(self) -> float:
        return round(time.monotonic() - self.start, 2)

    # --- run ---------------------------------------------------------------------------------
    async def run(self) -> dict:
        self.start = time.monotonic()
        chaos = asyncio.create_task(self.faults_loop())
        await self.load()
        load_s = time.monotonic() - self.start
        chaos.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        drained = await self.wait_drained()
        after = await self.after_chaos_check()
        return self.report(load_s, drained, after)

    async def wait_drained(self) -> dict:
        """Wait (bounded) until every worker is routable and reports no blocks, requests or
        staged KV; return what each reported last."""
        deadline = time.monotonic() + self.args.recovery_timeout_s
        while time.monotonic() < deadline and not all(h.alive for h in self.client.workers.values()):
            await asyncio.sleep(0.2)
        deadline = time.monotonic() + self.args.drain_timeout_s
        while time.monotonic() < deadline:
            if all(h.alive and h.last_report is not None and not h.last_report.num_kv_blocks_used
                   and not h.last_report.num_running_reqs and not h.last_report.num_waiting_reqs
                   and not h.counters.num_staged for h in self.client.workers.values()):
                break
            await asyncio.sleep(0.2)
        return {w: {"alive": h.alive,
                    "kv_blocks_used": h.last_report.num_kv_blocks_used if h.last_report else None,
                    "running": h.last_report.num_running_reqs if h.last_report else None,
                    "waiting": h.last_report.num_waiting_reqs if h.last_report else None,
                    "staged": h.counters.num_staged}
                for w, h in sorted(self.client.workers.items())}

    async def after_chaos_check(self, num: int = 4) -> dict:
        """A few requests once the dust settled: all must succeed and equal the reference."""
        before = len(self.outcomes)
        await asyncio.gather(*[self.one_request(i) for i in range(num)])
        checks = self.outcomes[before:]
        del self.outcomes[before:]
        return {"num": num, "num_ok": sum(1 for o in checks if o.status == "completed"
                                          and o.equal_to_reference),
                "errors": [o.error for o in checks if o.error]}

    def report(self, load_s: float, drained: dict, after: dict) -> dict:
        status = Counter(o.status for o in self.outcomes)
        done = [o for o in self.outcomes if o.status == "completed"]
        errors = Counter(re.sub(r"\d+(\.\d+)?", "N", o.error)[:160]
                         for o in self.outcomes if o.status == "failed")
        sup = self.client.supervisor
        recoveries = [f.recovery_s for f in self.faults if f.recovery_s is not None]
        return {
            "requests_sent": len(self.outcomes), "completed": status["completed"],
            "failed_with_error": status["failed"], "hung": status["hung"],
            "completed_equal_to_reference": sum(1 for o in done if o.equal_to_reference),
            "completed_not_equal": [o.request_id for o in done if not o.equal_to_reference],
            "error_kinds": dict(errors.most_common()),
            "kv_blocks_used_after_drain": {w: d["kv_blocks_used"] for w, d in drained.items()},
            "workers_after_drain": drained,
            "restarts": dict(sup.num_restarts), "gave_up": dict(sup.num_gave_up),
            "faults": [asdict(f) for f in self.faults],
            "recovery_s": {"num": len(recoveries), "max": max(recoveries, default=None),
                           "mean": sum(recoveries) / len(recoveries) if recoveries else None},
            "store_corrupt_blocks_detected_since_restart": sum(
                h.counters.store_corrupt_blocks for h in self.client.workers.values()),
            "after_chaos": after, "load_s": round(load_s, 1),
            "latency_s_p50_completed": _percentile([o.latency_s for o in done], 50),
            "latency_s_p99_completed": _percentile([o.latency_s for o in done], 99),
        }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def print_table(result: dict) -> None:
    rows = [
        ("requests sent", result["requests_sent"]),
        ("completed", result["completed"]),
        ("failed with a clear error", result["failed_with_error"]),
        ("hung (client timeout)", result["hung"]),
        ("completed equal to reference", f"{result['completed_equal_to_reference']} / "
                                         f"{result['completed']}"),
        ("KV blocks in use after drain", ", ".join(
            f"{w}={n}" for w, n in result["kv_blocks_used_after_drain"].items())),
        ("restarts (prefill / decode)", f"{result['restarts'].get('prefill', 0)} / "
                                        f"{result['restarts'].get('decode', 0)}"),
        ("recovery after a fault, mean / max s",
         "-" if not result["recovery_s"]["num"] else
         f"{result['recovery_s']['mean']:.1f} / {result['recovery_s']['max']:.1f} "
         f"({result['recovery_s']['num']} faults)"),
        ("after chaos: requests ok", f"{result['after_chaos']['num_ok']} / "
                                     f"{result['after_chaos']['num']}"),
    ]
    print("| metric | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print("\n| t (s) | fault | worker | detail | left routing | restarted | routable again "
          "after (s) |\n|---|---|---|---|---|---|---|")
    yes_no = {None: "-", True: "yes", False: "no"}
    for f in result["faults"]:
        rec = "-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}"
        print(f"| {f['at_s']:.0f} | {f['kind']} | {f['worker_id'] or '-'} | {f['detail']} | "
              f"{yes_no[f['left_routing']]} | {yes_no[f['lost']]} | {rec} |")
    if result["error_kinds"]:
        print("\nerrors:")
        for message, count in result["error_kinds"].items():
            print(f"  {count} x {message}")


async def serve_and_run(args, engine: EngineConfig, prompts, references, params) -> dict:
    with tempfile.TemporaryDirectory(prefix="deepinfer-chaos-") as tmp:
        cluster = ClusterConfig(
            num_prefill_workers=2, num_decode_workers=2, kv_store_url=f"fs://{tmp}",
            heartbeat_timeout_s=args.heartbeat_timeout_s, stall_timeout_s=args.stall_timeout_s,
            hung_restart_after_s=args.hung_restart_after_s,
            transfer_timeout_s=10.0, restart_backoff_s=0.5)
        client = make_client(engine, cluster=cluster)
        t0 = time.monotonic()
        await client.start()
        print(f"cluster up in {time.monotonic() - t0:.1f} s; load for {args.duration_s:.0f} s "
              f"at {args.rate} req/s", flush=True)
        try:
            run = ChaosRun(args, client, Path(tmp), prompts, references, params)
            return await run.run()
        finally:
            await client.shutdown()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=240.0, help="seconds of load")
    p.add_argument("--rate", type=float, default=0.6, help="request arrivals per second")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--fault-interval-s", type=float, default=15.0)
    p.add_argument("--corrupt-blocks", type=int, default=4, help="store files hit per corruption")
    p.add_argument("--heartbeat-timeout-s", type=float, default=5.0,
                   help="a silent worker is suspended from routing after this long")
    p.add_argument("--hung-restart-after-s", type=float, default=6.0,
                   help="a worker suspended this long is killed and restarted")
    p.add_argument("--max-stop-s", type=float, default=15.0,
                   help="SIGSTOP pauses last 1 s to this long (then SIGCONT)")
    p.add_argument("--stall-timeout-s", type=float, default=30.0)
    p.add_argument("--client-timeout-s", type=float, default=120.0)
    p.add_argument("--recovery-timeout-s", type=float, default=300.0,
                   help="how long a faulted worker may take to be routable again")
    p.add_argument("--drain-timeout-s", type=float, default=60.0,
                   help="how long routable workers may take to report no KV in use after the load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.duration_s <= 0 or args.rate <= 0 or args.fault_interval_s <= 0:
        p.error("duration, rate and fault interval must be positive")
    if args.client_timeout_s <= args.stall_timeout_s:
        p.error("--client-timeout-s must exceed --stall-timeout-s (the front gives up first)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    engine = EngineConfig(dtype="float32", num_kv_blocks=256, num_threads=1, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    mean = args.duration_s * args.rate  # Poisson arrivals: mean + 4 sigma is plenty
    num = int(mean + 4 * mean ** 0.5) + 8
    t0 = time.monotonic()
    prompts, references = prompts_and_references(engine, num, args.seed, params)
    print(f"reference outputs of {num} prompts in {time.monotonic() - t0:.1f} s", flush=True)
    result = asyncio.run(serve_and_run(args, engine, prompts, references, params))
    result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result["command"] = " ".join(["python benchmarks/chaos.py",
                                  *(sys.argv[1:] if argv is None else argv)])
    result["load_average_1m"] = {"start": load_start, "end": os.getloadavg()[0]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
