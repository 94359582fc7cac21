"""Measure real step times over a grid of batch shapes and fit the cost model to them.

`StepProfiler` runs synthetic `SchedulerOutput`s (random token ids, distinct KV blocks, written
before they are read) through the real `ModelRunner.execute` and keeps the median of a few
repeats per batch, the repeats taken in rounds over the grid. `profile_cost_model` fits
`CostModel` on a seeded share of the grid and reports its error on the held-out rest; the
coefficients written are those that were evaluated.

Two grids: `QUICK_GRID` (seconds; start-up profiling, cached per model shape, dtype, device and
threads under ~/.cache/deepinfer/profiles) and `FULL_GRID` (`deepinfer profile`).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.core.cost_model import ChunkShape, CostModel, StepSample
from deepinfer.core.model_shape import ModelShape
from deepinfer.core.scheduler_output import ScheduledRequest, SchedulerOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.core.timing_stats import repeat_cv

logger = logging.getLogger(__name__)

GRID_VERSION = 6  # 5: decode batches on both sides of the fused decode stack's row limit;
# 6: 768-token prefill chunks (full-budget steps were extrapolated from 256, over by 3-6%)


@dataclass(frozen=True)
class ProfileGrid:
    """Batch shapes to time. Every combination of each family is one measured step:
    prefill: one chunk of x tokens after P; decode: B requests of one token at context C;
    mixed: B decodes at C plus one chunk of x after P; ragged: random decode batches with
    mixed contexts plus 0-2 random chunks (the realistic case a scheduler produces)."""

    name: str
    prefill_tokens: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    decode_batch_sizes: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed_decodes: tuple[int, ...]
    mixed_chunks: tuple[int, ...]
    num_ragged: int
    num_repeats: int
    num_warmup: int  # untimed runs of each batch before its timed repeats
    holdout_fraction: float = 0.3
    seed: int = 0
    ragged_max_chunk: int | None = None  # largest random chunk (None: max(prefill_tokens))

    def batches(self, max_tokens_per_request: int) -> list[tuple[ChunkShape, ...]]:
        """All batches of the grid whose requests fit `max_tokens_per_request` (P + x)."""
        rng = random.Random(self.seed)
        out: list[tuple[ChunkShape, ...]] = []
        for x in self.prefill_tokens:
            out += [(ChunkShape(p, x),) for p in self.prefill_contexts]
        for b in self.decode_batch_sizes:
            out += [tuple(ChunkShape(c, 1) for _ in range(b)) for c in self.decode_contexts]
        for b in self.mixed_decodes:
            for x in self.mixed_chunks:
                c, p = rng.choice(self.decode_contexts), rng.choice(self.prefill_contexts)
                out.append(tuple(ChunkShape(c, 1) for _ in range(b)) + (ChunkShape(p, x),))
        for _ in range(self.num_ragged):
            out.append(self._ragged_batch(rng))
        return [b for b in out if all(c.context_len + c.num_new_tokens <= max_tokens_per_request
                                      for c in b)]

    def _ragged_batch(self, rng: random.Random) -> tuple[ChunkShape, ...]:
        max_c, max_b = max(self.decode_contexts), max(self.decode_batch_sizes)
        decodes = [ChunkShape(rng.randint(1, max_c), 1) for _ in range(rng.randint(0, max_b))]
        chunks = [ChunkShape(rng.choice(self.prefill_contexts) + 16 * rng.randint(0, 8),
                             rng.randint(2, self.ragged_max_chunk or max(self.prefill_tokens)))
                  for _ in range(rng.randint(0 if decodes else 1, 2))]
        return tuple(decodes + chunks)


QUICK_GRID = ProfileGrid(
    name="quick", prefill_tokens=(32, 128, 256, 768), prefill_contexts=(0, 1024, 2048),
    decode_batch_sizes=(1, 4, 8, 16, 32), decode_contexts=(64, 1024, 2048),
    mixed_decodes=(4, 16), mixed_chunks=(64,), num_ragged=10, num_repeats=2, num_warmup=0,
    ragged_max_chunk=256)

FULL_GRID = ProfileGrid(
    name="full", prefill_tokens=(16, 64, 128, 256, 512), prefill_contexts=(0, 512, 1536, 3072),
    decode_batch_sizes=(1, 4, 16, 32), decode_contexts=(32, 512, 1536, 3072),
    mixed_decodes=(4, 16, 32), mixed_chunks=(32, 128, 384), num_ragged=24, num_repeats=3,
    num_warmup=1)


class StepProfiler:
    """Times synthetic steps on a real runner. The runner's KV cache must be otherwise idle
    (start-up, or a dedicated runner): the profiler writes into its blocks."""

    def __init__(self, runner, vocab_size: int, seed: int = 0) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.block_size: int = runner.block_size
        self.num_blocks: int = runner.cache.num_blocks
        self._rng = random.Random(seed)
        self._next_block = 0
        self._filled_blocks = 0
        self._params = SamplingParams(temperature=0.0, max_tokens=1)

    @property
    def max_tokens_per_request(self) -> int:
        return self.num_blocks * self.block_size

    def measure(self, chunks: tuple[ChunkShape, ...], num_repeats: int, num_warmup: int = 1
                ) -> float:
        """Median seconds of `num_repeats` runs of one batch, after `num_warmup` untimed ones."""
        return self.run([chunks], num_repeats, num_warmup, warm_up_runner=False)[0].step_time_s

    def run(self, batches: list[tuple[ChunkShape, ...]], num_repeats: int, num_warmup: int,
            progress: Callable[[int, int], None] | None = None, *,
            warm_up_runner: bool = True) -> list[StepSample]:
        """Median time of each batch. Repeats run in rounds over the whole grid, so a burst of
        load from other processes spreads over many batches instead of skewing one."""
        if num_repeats < 1 or num_warmup < 0:
            raise ValueError("need num_repeats >= 1 and num_warmup >= 0")
        if warm_up_runner:  # first steps pay for allocator growth and kernel selection
            self.run([(ChunkShape(64, 1), ChunkShape(0, 64))], 1, 1, warm_up_runner=False)
        outputs = [self._make_output(chunks, tag=str(i)) for i, chunks in enumerate(batches)]
        times: list[list[float]] = [[] for _ in batches]
        cpu_times: list[list[float]] = [[] for _ in batches]
        num_rounds = num_warmup + num_repeats
        for r in range(num_rounds):
            for i, output in enumerate(outputs):
                cpu_start = time.process_time()
                step_time_s = self.runner.execute(output).step_time_s
                if r >= num_warmup:
                    times[i].append(step_time_s)
                    cpu_times[i].append(time.process_time() - cpu_start)
                if progress is not None:
                    progress(r * len(outputs) + i + 1, num_rounds * len(outputs))
        # Let the runner drop its per-request sampler state.
        self.runner.execute(SchedulerOutput([], 0, finished_request_ids=[
            s.request_id for o in outputs for s in o.scheduled]))
        # CPU seconds of each batch too: on a loaded host a step's wall time includes time
        # the process waited for a core; its CPU time is the work itself.
        self.cpu_times_s = [statistics.median(t) for t in cpu_times]
        self.repeat_times_s = times  # every timed repeat: their spread is the step-time noise
        return [StepSample(chunks, statistics.median(t)) for chunks, t in zip(batches, times)]

    def _make_output(self, chunks: tuple[ChunkShape, ...], tag: str) -> SchedulerOutput:
        """Each batch's requests get distinct blocks from block 0 up (wrapping only if the
        batch is larger than the cache), so the fill is bounded by the largest batch."""
        scheduled = []
        self._next_block = 0
        for i, c in enumerate(chunks):
            num_blocks = -(-(c.context_len + c.num_new_tokens) // self.block_size)
            scheduled.append(ScheduledRequest(
                request_id=f"profile-{tag}-{i}",
                token_ids=[self._rng.randrange(self.vocab_size) for _ in range(c.num_new_tokens)],
                num_computed_tokens=c.context_len, block_ids=self._take_blocks(num_blocks),
                sample=True, sampling_params=self._params, num_output_tokens=0))
        return SchedulerOutput(scheduled, sum(c.num_new_tokens for c in chunks))

    def _take_blocks(self, n: int) -> list[int]:
        if n > self.num_blocks:
            raise ValueError(f"a request needs {n} blocks; the cache has {self.num_blocks}")
        block_ids = [(self._next_block + j) % self.num_blocks for j in range(n)]
        self._next_block = (self._next_block + n) % self.num_blocks
        end = max(block_ids) + 1
        if end > self._filled_blocks:
            self._fill(self._filled_blocks, end)
        return block_ids

    def _fill(self, lo: int, hi: int) -> None:
        """Write blocks [lo, hi) once, so no read hits untouched (zero-page) memory. Attention
        and matmul speed does not depend on the values, so a constant is written (memory speed;
        random values would cost seconds per GB)."""
        cache = self.runner.cache
        for start in range(lo, hi, 256):
            block_ids = list(range(start, min(hi, start + 256)))
            cache.write_blocks(block_ids, cache.read_blocks(block_ids).fill_(0.01))
        self._filled_blocks = max(self._filled_blocks, hi)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.processor() or platform.machine()}"


def small_decode_rows(runner) -> int | None:
    """The most rows of the decode-only steps the runner's model sends to its fused decode
    stack (None: no stack, every step takes the per-op path)."""
    inner = getattr(getattr(runner, "model", None), "model", None)
    stack = getattr(inner, "decode_stack", None)
    if stack is None:
        return None
    from deepinfer.runtime.cpu_decode_stack import MAX_ROWS
    return MAX_ROWS


def profile_cost_model(runner, shape: ModelShape, vocab_size: int, grid: ProfileGrid, *,
                       metadata: dict | None = None,
                       progress: Callable[[int, int], None] | None = None) -> CostModel:
    """Time `grid` on `runner`, fit on a seeded (1 - holdout_fraction) share, evaluate on the
    rest. The returned model carries `holdout_error` and metadata (device, threads, grid...).
    Piecewise where the runner is: small decode-only steps get their own coefficients when the
    model has a fused decode stack."""
    profiler = StepProfiler(runner, vocab_size, seed=grid.seed)
    batches = grid.batches(profiler.max_tokens_per_request)
    load_at_start = os.getloadavg()[0]  # other processes skew CPU timings: record it
    samples = profiler.run(batches, grid.num_repeats, grid.num_warmup, progress)
    order = list(range(len(samples)))
    random.Random(grid.seed + 1).shuffle(order)
    num_holdout = max(1, int(round(len(samples) * grid.holdout_fraction)))
    holdout = [samples[i] for i in order[:num_holdout]]
    train = [samples[i] for i in order[num_holdout:]]
    meta = {
        "device": device_name(runner.device),
        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()[0],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "grid": grid.name, "grid_version": GRID_VERSION,
        "num_train_steps": len(train), "num_holdout_steps": len(holdout),
        "small_decode_rows": small_decode_rows(runner),
        **(metadata or {}),
    }
    model = CostModel.fit_piecewise(shape, train, meta["small_decode_rows"], metadata=meta)
    model.holdout_error = model.evaluate(holdout)
    fit_error = model.evaluate(train)
    model.metadata["fit_median_abs_pct_error"] = fit_error.median_abs_pct_error
    model.metadata["fit_p90_abs_pct_error"] = fit_error.p90_abs_pct_error
    model.metadata["samples"] = [_sample_dict(s, cpu)
                                 for s, cpu in zip(samples, profiler.cpu_times_s)]
    # Run-to-run noise of a step on this host (the simulator's default `noise.step_time_cv`):
    # the spread of the same batch over the repeat rounds. None with one repeat.
    model.metadata["step_time_cv"] = repeat_cv(profiler.repeat_times_s)
    return model


def _sample_dict(sample: StepSample, cpu_s: float | None = None) -> dict:
    out = {"chunks": [[c.context_len, c.num_new_tokens] for c in sample.chunks],
           "step_time_s": sample.step_time_s}
    if cpu_s is not None:
        out["cpu_s"] = cpu_s
    return out


def grid_with(grid: ProfileGrid, **changes) -> ProfileGrid:
    """A copy of `grid` with some fields changed (e.g. fewer repeats for a smoke run)."""
    return dataclasses.replace(grid, **changes)


# ---- host work around the model step ----------------------------------------------------------
HOST_OVERHEAD_BATCH_SIZES = (1, 4, 16, 32)


def measure_host_overhead(engine, *, batch_sizes: tuple[int, ...] = HOST_OVERHEAD_BATCH_SIZES,
                          num_steps: int = 8, prompt_len: int = 16,
                          after_step: Callable[[list], None] | None = None,
                          clock: Callable[[], float] = time.perf_counter) -> dict:
    """Seconds a real engine loop spends per step outside the model runner: `engine.step()`'s
    wall time minus the runner's own step time (scheduling, sampling bookkeeping,
    detokenisation, output objects), plus `after_step(outputs)` (what the serving loop does
    with them: output deltas, encoding). Decode steps of B requests for each B in
    `batch_sizes`; the per-B medians are fitted as `per_step_s + per_request_s * B` (least
    squares, clipped at 0). The engine must be idle; its requests are aborted afterwards."""
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    medians: list[tuple[int, float]] = []
    for b in batch_sizes:
        ids = [f"host-overhead-{b}-{i}" for i in range(b)]
        params = SamplingParams(temperature=0.0, max_tokens=num_steps + 4, ignore_eos=True)
        for request_id in ids:
            engine.add_request(request_id, [rng.randrange(100, vocab) for _ in range(prompt_len)],
                               params)
        while any(r.num_computed_tokens < prompt_len
                  for r in engine.scheduler.requests.values()):
            engine.step()  # prefill, not measured
        overheads = []
        for _ in range(num_steps):
            start = clock()
            outputs = engine.step()
            if after_step is not None:
                after_step(outputs)
            wall = clock() - start
            overheads.append(max(0.0, wall - engine.get_stats().step_time_s))
        engine.abort_request(ids)
        medians.append((b, statistics.median(overheads)))
    per_step, per_request = _fit_line(medians)
    return {"per_step_s": per_step, "per_request_s": per_request,
            "samples": [[b, s] for b, s in medians], "num_steps": num_steps}


def _fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares a + b·x over (x, y), both clipped at 0 (an overhead is not negative)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    b = max(0.0, b)
    return max(0.0, my - b * mx), b


def measure_kv_transport(engine, make_transport: Callable[[bool], object], *,
                         token_counts: tuple[int, ...] = (64, 256, 1024),
                         num_repeats: int = 3) -> dict:
    """The disaggregated KV path on this host, end to end as a request pays it: the prefill
    side's staging copy (`read_blocks`), a pull over the real transport
    (`make_transport(serve)`, e.g. `ZmqKVTransport`: loopback TCP, both endpoints in this
    process) and the decode side's `write_blocks`. Median seconds per size, fitted as
    `latency + bytes / bandwidth`. Beside the wall time, the CPU seconds per GB each end
    spends (`cpu_s_per_gb`: the simulator's `host.kv_transfer_cpu_s_per_gb`): the sender's
    staging copy and the receiver's write on this thread, plus the transport's own threads
    (process CPU minus this thread's), split evenly between the two ends (a loopback send and
    receive of the same bytes); this thread's polling wait is not counted. Measure with one
    torch thread (as `--threads 1`): idle OpenMP threads spin after a copy and would count."""
    cache = engine.cache
    block_size = engine.config.block_size
    bytes_per_token = cache.spec.bytes_per_block / block_size
    server, client = make_transport(True), make_transport(False)
    points, send_points, recv_points = [], [], []
    try:
        for tokens in token_counts:
            num_blocks = min(-(-tokens // block_size), cache.num_blocks)
            block_ids = list(range(num_blocks))
            times, send_cpu, recv_cpu = [], [], []
            for r in range(num_repeats):
                request_id = f"kv-transport-{tokens}-{r}"
                start = time.perf_counter()
                process0, thread0 = time.process_time(), time.thread_time()
                kv = cache.read_blocks(block_ids)
                server.stage(request_id, kv, ttl_s=30.0)
                send_s = time.thread_time() - thread0
                client.fetch(request_id, server.address, timeout_s=30.0)
                deadline = start + 30.0
                result = None
                while result is None and time.perf_counter() < deadline:
                    done = client.poll()
                    result = done[0] if done else None
                    if result is None:
                        time.sleep(0.0005)
                if result is None or result.kv is None:
                    raise RuntimeError(f"KV transport loopback failed: "
                                       f"{result.error if result else 'timed out'}")
                thread1 = time.thread_time()
                cache.write_blocks(block_ids, result.kv)
                times.append(time.perf_counter() - start)
                recv_s = time.thread_time() - thread1
                others = (time.process_time() - process0) - (time.thread_time() - thread0)
                send_cpu.append(send_s + max(0.0, others) / 2)
                recv_cpu.append(recv_s + max(0.0, others) / 2)
            num_bytes = num_blocks * block_size * bytes_per_token
            points.append((num_bytes, statistics.median(times)))
            send_points.append((num_bytes, statistics.median(send_cpu)))
            recv_points.append((num_bytes, statistics.median(recv_cpu)))
    finally:
        server.close()
        client.close()
    latency, s_per_byte = _fit_line(points)
    return {"latency_ms": latency * 1e3,
            "bandwidth_gb_s": (1.0 / s_per_byte / 1e9) if s_per_byte else float("inf"),
            "samples": [[n, s] for n, s in points],
            "cpu_s_per_gb": {"sender": _fit_line(send_points)[1] * 1e9,
                             "receiver": _fit_line(recv_points)[1] * 1e9},
            "cpu_samples": [[n, s, r] for (n, s), (_, r) in zip(send_points, recv_points)]}


def measure_store_publish(engine, publish: Callable[[object], None], flush: Callable[[], None],
                          *, num_tokens: int = 768, num_repeats: int = 3) -> dict:
    """CPU seconds per KV byte a prefill worker spends publishing computed blocks to the shared
    store: `publish(kv)` (the worker's copy out of the cache, encoding, queueing) then
    `flush()` (the writer thread's checksums and writes), for one prompt of `num_tokens`.
    Process CPU time (all threads), not wall: it is CPU the worker takes from the host's
    cores, and it is what on a shared box is least disturbed by other processes."""
    cache = engine.cache
    block_size = engine.config.block_size
    num_blocks = min(-(-num_tokens // block_size), cache.num_blocks)
    block_ids = list(range(num_blocks))
    num_bytes = num_blocks * cache.spec.bytes_per_block
    times = []
    for _ in range(num_repeats):
        start = time.process_time()
        publish(cache.read_blocks(block_ids))
        flush()
        times.append(time.process_time() - start)
    cpu_s = statistics.median(times)
    return {"s_per_byte": cpu_s / num_bytes, "num_bytes": num_bytes, "cpu_s": cpu_s}
