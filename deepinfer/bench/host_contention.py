"""How processes sharing this host slow each other's steps, measured for the simulator's host model.

`measure_host_sharing`: k single-thread matmul processes at once vs one alone (`host: {sharing:
measured}`). `measure_time_sharing`: the real runner's steps per CPU-second with a second process
pinned to the same core vs alone (`host: {time_sharing: measured}`). `measure_memory_contention`:
small decode steps per CPU-second with a neighbour on another core vs alone (`host:
{memory_contention: measured}`). `deepinfer profile --host-sharing / --time-sharing /
--memory-contention` writes them into a profile's metadata.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from deepinfer.core.cost_model import ChunkShape
from deepinfer.core.scheduler_output import SchedulerOutput
from deepinfer.runtime.profiler import StepProfiler


def _sharing_child(start, results, duration_s: float, size: int) -> None:
    """One single-thread process doing matmuls for `duration_s` once all are at `start`."""
    torch.set_num_threads(1)
    a = torch.randn(size, size, dtype=torch.bfloat16)
    b = torch.randn(size, size, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start.wait()
    end = time.perf_counter() + duration_s
    n = 0
    while time.perf_counter() < end:
        a @ b
        n += 1
    results.put(n / duration_s)


def measure_host_sharing(max_procs: int = 4, duration_s: float = 1.5, size: int = 512) -> dict:
    """How fast each of k single-thread processes runs while k run at once on this host,
    relative to one alone (k = 1..max_procs): the speed table the simulator uses for workers
    that share the host's cores (`host: {sharing: measured}`). Captures what cores / k does
    not: SMT siblings, shared caches and memory bandwidth, frequency."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    rates = []
    for k in range(1, max_procs + 1):
        start, results = ctx.Barrier(k + 1), ctx.Queue()  # k children + this process
        procs = [ctx.Process(target=_sharing_child, args=(start, results, duration_s, size),
                             daemon=True) for _ in range(k)]
        for p in procs:
            p.start()
        start.wait(timeout=120.0)  # every child imported torch and warmed up: go together
        per_proc = [results.get(timeout=120.0) for _ in procs]
        for p in procs:
            p.join(10.0)
        rates.append(statistics.mean(per_proc))
    return {"speed": [r / rates[0] for r in rates], "max_procs": max_procs,
            "duration_s": duration_s}


# ---- a time-shared core -----------------------------------------------------------------------
TIME_SHARING_CONTEXT = 300
# kind -> the batches measured (decode kinds follow the piecewise cost model's split)
TIME_SHARING_BATCHES = {
    "decode": ((ChunkShape(TIME_SHARING_CONTEXT, 1),) * 4,),
    "large_decode": ((ChunkShape(TIME_SHARING_CONTEXT, 1),) * 16,),
    "prefill": ((ChunkShape(0, 256),), (ChunkShape(0, 768),)),
}
# What the competing process runs, alternately: a decode and a prefill step, as the other
# workers of a P/D run do.
TIME_SHARING_COMPETITOR = ((ChunkShape(TIME_SHARING_CONTEXT, 1),) * 16, (ChunkShape(0, 256),))


def _time_sharing_child(engine_kwargs: dict, core: int, go, idle, steps,
                        competitor: tuple = TIME_SHARING_COMPETITOR) -> None:
    """The competitor: the same model's steps (`competitor`, in turn) on `core`, while `go`
    is set."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    from deepinfer.engine.engine_config import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(**engine_kwargs))
    profiler = StepProfiler(engine.runner, engine.model_config.vocab_size, seed=1)
    outputs = [profiler._make_output(chunks, tag=f"rival{i}")
               for i, chunks in enumerate(competitor)]
    for output in outputs:  # warm up before the first measurement
        engine.runner.execute(output)
    while True:
        if not go.is_set():
            idle.set()
            go.wait()
            idle.clear()
        for output in outputs:
            engine.runner.execute(output)
            with steps.get_lock():
                steps.value += 1


def _steps_per_cpu_second(runner, outputs: list, cpu_s: float) -> float:
    """Run `outputs` in turn until this process used `cpu_s` CPU seconds; steps per CPU-s."""
    start = time.process_time()
    n = 0
    while True:
        for output in outputs:
            runner.execute(output)
            n += 1
        used = time.process_time() - start
        if used >= cpu_s:
            return n / used


def _alone_then_shared(runner, outputs: list, cpu_s: float, child, go, idle, steps,
                       who: str) -> tuple[float, float]:
    """One round: steps per CPU-second with the competitor paused, then once it is running
    steps again (not merely waking up), then pause it; (alone, shared)."""
    alone = _steps_per_cpu_second(runner, outputs, cpu_s)
    before = steps.value
    go.set()
    deadline = time.monotonic() + 60.0
    while steps.value == before:  # it is running steps, not waking up
        if time.monotonic() > deadline or not child.is_alive():
            raise RuntimeError(f"the {who} process stopped")
        os.sched_yield()
    shared = _steps_per_cpu_second(runner, outputs, cpu_s)
    go.clear()
    if not idle.wait(60.0):
        raise RuntimeError(f"the {who} process did not pause")
    return alone, shared


def measure_time_sharing(runner, vocab_size: int, engine_kwargs: dict, *, cpu_s: float = 1.0,
                         repeats: int = 3, core: int | None = None,
                         batches: dict | None = None) -> dict:
    """How much work a step does per CPU-second while its core is time-shared, relative to
    alone, per step kind (the simulator's `host: {time_sharing: measured}`). This process runs
    single-threaded, pinned to `core`; a second process, pinned to the same core, runs the same
    model's steps (a 16-row decode and a 256-token prefill, alternately) or waits. For each kind:
    steps per CPU-second alone, then shared; efficiency = shared / alone, the median of
    `repeats` rounds. Two threads on one core evict each other's caches at every switch, which
    an other-core neighbour does not (it changes nothing measurable here)."""
    import multiprocessing

    if repeats < 1 or cpu_s <= 0:
        raise ValueError("need repeats >= 1 and cpu_s > 0")
    batches = TIME_SHARING_BATCHES if batches is None else batches
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = min(affinity) if core is None else core
    ctx = multiprocessing.get_context("spawn")
    go, idle, steps = ctx.Event(), ctx.Event(), ctx.Value("l", 0)
    child = ctx.Process(target=_time_sharing_child, args=(engine_kwargs, core, go, idle, steps),
                        daemon=True)
    profiler = StepProfiler(runner, vocab_size, seed=2)
    outputs = {kind: [profiler._make_output(c, tag=f"ts-{kind}{i}") for i, c in enumerate(b)]
               for kind, b in batches.items()}
    alone: dict[str, list[float]] = {k: [] for k in outputs}
    shared: dict[str, list[float]] = {k: [] for k in outputs}
    child.start()
    try:
        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
        if not idle.wait(300.0):  # loaded its model and warmed up
            raise RuntimeError("the competing process did not start")
        for kind_outputs in outputs.values():  # warm-up
            for output in kind_outputs:
                runner.execute(output)
        for _ in range(repeats):
            for kind, kind_outputs in outputs.items():
                a, b = _alone_then_shared(runner, kind_outputs, cpu_s, child, go, idle, steps,
                                          "competing")
                alone[kind].append(a)
                shared[kind].append(b)
    finally:
        child.kill()
        child.join(10.0)
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
        runner.execute(SchedulerOutput([], 0, finished_request_ids=[
            s.request_id for outs in outputs.values() for o in outs for s in o.scheduled]))
    # Sharing never speeds a step up: a median a little over 1 is noise, stored as 1.
    out: dict = {kind: min(1.0, statistics.median(s / a for s, a in zip(shared[kind], alone[kind])))
                 for kind in outputs}
    out.update({
        "method": "real runner, 1 thread, pinned with a second process running the same "
                  "model's steps (decode 16 rows + prefill 256, alternately) to one core: "
                  "steps per CPU-second shared / alone, median of rounds",
        "batches": {k: [[[c.context_len, c.num_new_tokens] for c in chunks] for chunks in b]
                    for k, b in batches.items()},
        "steps_per_cpu_s_alone": {k: statistics.median(v) for k, v in alone.items()},
        "steps_per_cpu_s_shared": {k: statistics.median(v) for k, v in shared.items()},
        "rounds": {k: [s / a for s, a in zip(shared[k], alone[k])] for k in outputs},
        "core": core, "cpu_s": cpu_s, "repeats": repeats,
        "load_average": os.getloadavg()[0],
    })
    return out


# ---- a busy neighbour on the other core ---------------------------------------------------------
# The step measured: a small decode (the fused decode stack, which streams all the weights).
MEMORY_CONTENTION_BATCH = (ChunkShape(TIME_SHARING_CONTEXT, 1),) * 4
# What the neighbour loops: the same small decode, or a compute-bound prefill chunk.
MEMORY_CONTENTION_NEIGHBOURS = {
    "decode": MEMORY_CONTENTION_BATCH,
    "prefill": (ChunkShape(0, 768),),
}


def measure_memory_contention(runner, vocab_size: int, engine_kwargs: dict, *,
                              cpu_s: float = 1.0, repeats: int = 3) -> dict:
    """Small decode steps per CPU-second while a neighbour process on ANOTHER core loops a
    small decode or a prefill chunk, relative to alone (the simulator's
    `host: {memory_contention: measured}`). This process runs single-threaded pinned to one
    core, the neighbour to another; alone and with-neighbour alternate, `repeats` rounds,
    median of the ratios. Two fused decode steps at once share the memory bandwidth / L3
    (benchmarks/decode_contention.py: +21% CPU); a prefill next door costs little."""
    import multiprocessing

    if repeats < 1 or cpu_s <= 0:
        raise ValueError("need repeats >= 1 and cpu_s > 0")
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if len(affinity) < 2:
        raise ValueError("memory contention needs two cores")
    core, other = sorted(affinity)[:2]
    ctx = multiprocessing.get_context("spawn")
    profiler = StepProfiler(runner, vocab_size, seed=4)
    outputs = [profiler._make_output(MEMORY_CONTENTION_BATCH, tag="mc-decode")]
    ratios: dict[str, list[float]] = {k: [] for k in MEMORY_CONTENTION_NEIGHBOURS}
    alone_all: list[float] = []
    try:
        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
        for output in outputs:  # warm-up
            runner.execute(output)
        for kind, batch in MEMORY_CONTENTION_NEIGHBOURS.items():
            go, idle, steps = ctx.Event(), ctx.Event(), ctx.Value("l", 0)
            child = ctx.Process(target=_time_sharing_child,
                                args=(engine_kwargs, other, go, idle, steps, (batch,)),
                                daemon=True)
            child.start()
            try:
                if not idle.wait(300.0):  # loaded its model and warmed up
                    raise RuntimeError("the neighbour process did not start")
                for _ in range(repeats):
                    alone, shared = _alone_then_shared(runner, outputs, cpu_s, child, go, idle,
                                                       steps, "neighbour")
                    alone_all.append(alone)
                    ratios[kind].append(shared / alone)
            finally:
                child.kill()
                child.join(10.0)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
        runner.execute(SchedulerOutput([], 0, finished_request_ids=[
            s.request_id for o in outputs for s in o.scheduled]))
    return {
        # A neighbour never speeds a step up: a median over 1 is noise, stored as 1.
        "decode_with_decode": min(1.0, statistics.median(ratios["decode"])),
        "decode_with_prefill": min(1.0, statistics.median(ratios["prefill"])),
        "method": "real runner, 1 thread pinned to one core, a second process pinned to "
                  "another looping a 4-row decode at context 300 (decode) or a 768-token "
                  "prefill (prefill): 4-row decode steps per CPU-second with / alone, "
                  "median of alternating rounds",
        "batch": [[c.context_len, c.num_new_tokens] for c in MEMORY_CONTENTION_BATCH],
        "neighbours": {k: [[c.context_len, c.num_new_tokens] for c in b]
                       for k, b in MEMORY_CONTENTION_NEIGHBOURS.items()},
        "steps_per_cpu_s_alone": statistics.median(alone_all),
        "rounds": ratios, "cores": [core, other], "cpu_s": cpu_s, "repeats": repeats,
        "load_average": os.getloadavg()[0],
    }
