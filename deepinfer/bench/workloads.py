"""Benchmark workloads: what to send (token-id prompts, output lengths) and when (arrivals).

    random          --input-len/--output-len (optionally +-range_ratio), random token ids
    shared-prefix   groups of prompts that share a system prompt of shared_prefix_len tokens
    trace:PATH      a public trace (Mooncake / Bailian JSONL with prefix hash_ids, Azure /
                    BurstGPT CSV, or a generic JSONL/CSV; see trace_formats.py), optionally shrunk
    images          random text plus images_per_request synthetic images per prompt (chat
                    endpoint; sizes from image_sizes; num_unique_images > 0 draws them from a
                    pool of that many, so images repeat and hit the embedding caches)

Arrivals are open-loop: Poisson at `request_rate` (seeded; inf = all at once) or the trace's own
timestamps times `time_scale`. Pure: stdlib + numpy; the same seed gives the same workload.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from deepinfer.bench.trace_formats import TraceOptions, read_trace_file
from deepinfer.bench.traces import HashBlockTokens, ShrinkConfig

DEFAULT_TOKEN_ID_RANGE = (1000, 30000)  # inside every modern vocabulary, clear of specials


@dataclass(frozen=True)
class ImageSpec:
    """A synthetic image: the client draws `width` x `height` random pixels from `seed`."""

    seed: int
    width: int
    height: int


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival_time_s: float  # from the start of the run
    images: tuple[ImageSpec, ...] = ()  # sent as data URLs (chat endpoint)


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "random"  # random | shared-prefix | trace:PATH
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    num_groups: int = 4
    shared_prefix_len: int = 512
    request_rate: float | None = None  # None: trace timestamps, else all at once
    time_scale: float = 1.0
    shrink: ShrinkConfig = field(default_factory=ShrinkConfig)
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE
    seed: int = 0
    images_per_request: int = 1  # images workload
    image_sizes: tuple[tuple[int, int], ...] = ((336, 336),)  # (width, height), drawn uniformly
    num_unique_images: int = 0  # 0: every image new; N: drawn from a pool of N
    trace_format: str = "auto"  # auto | mooncake | bailian | azure | burstgpt | generic
    trace_time_unit: str | None = None  # s | ms; None: the trace format's own
    trace_block_tokens: int | None = None  # tokens per hash id; None: the format's own
    trace_start: int = 0  # skip this many of the trace's requests (a later window of it)

    def __post_init__(self) -> None:
        self.trace_options()  # raises ValueError for a bad trace format / unit / block size
        if not (self.kind in ("random", "shared-prefix", "images") or self.kind.startswith("trace:")):
            raise ValueError(f"unknown workload {self.kind!r}: use random, shared-prefix, images "
                             "or trace:PATH")
        if self.images_per_request < 0 or self.num_unique_images < 0:
            raise ValueError("images_per_request and num_unique_images must be >= 0")
        if not self.image_sizes or any(w < 1 or h < 1 for w, h in self.image_sizes):
            raise ValueError("image sizes must be at least 1x1")
        checks = [(self.num_prompts >= 1, "num_prompts must be at least 1"),
                  (self.input_len >= 1 and self.output_len >= 1,
                   "input_len and output_len must be at least 1"),
                  (0.0 <= self.range_ratio < 1.0, "range_ratio must be in [0, 1)"),
                  (self.num_groups >= 1, "num_groups must be at least 1"),
                  (self.shared_prefix_len >= 0, "shared_prefix_len must be non-negative"),
                  (self.request_rate is None or self.request_rate > 0,
                   "request_rate must be positive (inf: all at once)"),
                  (self.time_scale > 0, "time_scale must be positive"),
                  (self.trace_start >= 0, "trace_start must be non-negative")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def trace_options(self) -> TraceOptions:
        return TraceOptions(self.trace_format, self.trace_time_unit, self.trace_block_tokens)


@dataclass(frozen=True)
class Workload:
    requests: list[BenchRequest]
    description: str  # one line for the report: what was generated / shrunk


def poisson_arrivals(num: int, request_rate: float, rng: np.random.Generator) -> list[float]:
    """Arrival times (s) of a Poisson process; all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num
    gaps = rng.exponential(1.0 / request_rate, num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _lengths(mean: int, ratio: float, num: int, rng: np.random.Generator) -> list[int]:
    if ratio == 0.0:
        return [mean] * num
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, num).tolist()


def random_workload(cfg: WorkloadConfig, rng: np.random.Generator) -> tuple[list, str]:
    low, high = cfg.token_id_range
    inputs = _lengths(cfg.input_len, cfg.range_ratio, cfg.num_prompts, rng)
    outputs = _lengths(cfg.output_len, cfg.range_ratio, cfg.num_prompts, rng)
    prompts = [rng.integers(low, high, n).tolist() for n in inputs]
    return list(zip(prompts, outputs)), (f"random: {cfg.num_prompts} prompts, input "
                                         f"{cfg.input_len}, output {cfg.output_len}")


def shared_prefix_workload(cfg: WorkloadConfig, rng: np.random.Generator) -> tuple[list, str]:
    """Prompt i = system prompt of group (i mod num_groups) + its own random question;
    the order is shuffled so a group's requests are interleaved with the others'."""
    low, high = cfg.token_id_range
    prefixes = [rng.integers(low, high, cfg.shared_prefix_len).tolist()
                for _ in range(cfg.num_groups)]
    groups = rng.permutation(np.arange(cfg.num_prompts) % cfg.num_groups).tolist()
    inputs = _lengths(cfg.input_len, cfg.range_ratio, cfg.num_prompts, rng)
    outputs = _lengths(cfg.output_len, cfg.range_ratio, cfg.num_prompts, rng)
    items = [(prefixes[g] + rng.integers(low, high, n).tolist(), o)
             for g, n, o in zip(groups, inputs, outputs)]
    return items, (f"shared-prefix: {cfg.num_prompts} prompts in {cfg.num_groups} groups, "
                   f"shared {cfg.shared_prefix_len} + own {cfg.input_len} tokens, "
                   f"output {cfg.output_len}")


def image_specs(cfg: WorkloadConfig, rng: np.random.Generator) -> list[tuple[ImageSpec, ...]]:
    """`images_per_request` images per prompt: new ones, or drawn from a pool of
    `num_unique_images` (repeats, as when users send the same picture again)."""
    def new(seed: int) -> ImageSpec:
        w, h = cfg.image_sizes[int(rng.integers(len(cfg.image_sizes)))]
        return ImageSpec(seed, int(w), int(h))

    k = cfg.images_per_request
    if cfg.num_unique_images == 0:
        return [tuple(new(i * k + j) for j in range(k)) for i in range(cfg.num_prompts)]
    pool = [new(s) for s in range(cfg.num_unique_images)]
    return [tuple(pool[int(j)] for j in rng.integers(len(pool), size=k)) for _ in range(cfg.num_prompts)]


def trace_workload(cfg: WorkloadConfig, rng: np.random.Generator
                   ) -> tuple[list, list[float], str]:
    path = cfg.kind.removeprefix("trace:")
    trace = read_trace_file(path, cfg.num_prompts, cfg.trace_options(), start=cfg.trace_start)
    rows = trace.rows
    if not rows:
        raise ValueError(f"trace {path!r} has no requests")
    low, high = cfg.token_id_range
    blocks = (HashBlockTokens(cfg.shrink.block_tokens(trace.block_tokens), low, high, cfg.seed)
              if trace.block_tokens else None)  # rows carry hash_ids exactly when it is set
    items = []
    for row in rows:
        n = cfg.shrink.input_len(row.input_len)
        prompt = (blocks.prompt(row.hash_ids, n, rng) if row.hash_ids is not None
                  else rng.integers(low, high, n).tolist())
        items.append((prompt, cfg.shrink.output_len(row.output_len)))
    times = [row.timestamp_s * cfg.time_scale for row in rows]
    mean_in = np.mean([row.input_len for row in rows])
    mean_out = np.mean([row.output_len for row in rows])
    window = f" from request {cfg.trace_start}" if cfg.trace_start else ""
    description = (f"trace {path} ({trace.describe()}): {len(rows)} requests{window} over "
                   f"{max(times):.1f} s (time x{cfg.time_scale:g}); trace mean input "
                   f"{mean_in:.0f}, output {mean_out:.0f}; shrunk: "
                   f"{cfg.shrink.describe(trace.block_tokens)}")
    return items, times, description


def build_workload(cfg: WorkloadConfig) -> Workload:
    """The requests of `cfg`, sorted by arrival time."""
    rng = np.random.default_rng(cfg.seed)
    trace_times = None
    images = [()] * cfg.num_prompts
    if cfg.kind == "random":
        items, description = random_workload(cfg, rng)
    elif cfg.kind == "images":
        items, description = random_workload(cfg, rng)
        images = image_specs(cfg, np.random.default_rng([cfg.seed, 2]))
        sizes = ", ".join(f"{w}x{h}" for w, h in cfg.image_sizes)
        pool = f"a pool of {cfg.num_unique_images}" if cfg.num_unique_images else "all distinct"
        description = description.replace("random:", "images:", 1) + (
            f", {cfg.images_per_request} image(s) of {sizes} per prompt ({pool})")
    elif cfg.kind == "shared-prefix":
        items, description = shared_prefix_workload(cfg, rng)
    else:
        items, trace_times, description = trace_workload(cfg, rng)
    if cfg.request_rate is not None or trace_times is None:
        rate = cfg.request_rate if cfg.request_rate is not None else math.inf
        times = poisson_arrivals(len(items), rate, np.random.default_rng([cfg.seed, 1]))
        description += f"; arrivals: {'all at once' if math.isinf(rate) else f'Poisson {rate:g}/s'}"
    else:
        times = trace_times
        description += "; arrivals: trace timestamps"
    requests = [BenchRequest(p, o, t, imgs) for (p, o), t, imgs in zip(items, times, images)]
    requests.sort(key=lambda r: r.arrival_time_s)
    return Workload(requests, description)
