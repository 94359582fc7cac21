"""Published large-scale DeepSeek-V3 deployments: their settings, their figures, and what the
roofline predicts for the same batch on the same hardware. Pure.

A deployment here is one phase (prefill or decode) run at a fixed per-GPU batch, as the posts
measured it: a prefill step of `tokens_per_gpu` tokens made of `prompt_len`-token prompts, or a
decode step of `seqs_per_gpu` sequences at `prompt_len` tokens of KV. The model's answer is the
roofline step (`sim.roofline`) for that batch on `num_accelerators` GPUs whose EP peers carry
the same load, with the routed-expert imbalance of the stated expert-load model (Zipf skew, the
engine's EPLB planner; `sim.expert_load`) averaged over `imbalance_steps` steps.

One number is calibrated and then frozen: the compute-efficiency scale. The roofline's GEMM and
attention efficiencies (60% / 40% of peak) are kernel microbenchmark figures (DeepGEMM's grouped
FP8 GEMMs reach 1,093-1,297 of 1,979 TFLOPS on H800); a whole step reaches less. `calibrate`
solves, on DeepSeek's own published profile (H800, perfectly balanced routing, the `CALIBRATION`
entries), the factor by which both efficiencies must be divided to reproduce it, and every other
deployment is predicted with the geometric mean of the two, without refitting.

MTP (DeepSeek's multi-token prediction): a decode step verifies `1 + mtp_draft_tokens` tokens
per sequence (that many GEMM rows and attention queries over one KV read,
`RooflineConfig.mtp_draft_tokens`) and emits `1 + mtp_acceptance · mtp_draft_tokens`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from deepinfer.core.cost_model import ChunkShape
from deepinfer.sim.analytic_model import analytic_model
from deepinfer.sim.expert_load import ExpertLoadSpec, ExpertLoadTracker
from deepinfer.sim.hardware import accelerator
from deepinfer.sim.roofline import RooflineConfig, RooflineStepTime

BASE_MFU = 0.6  # DeepGEMM grouped FP8 GEMMs: 1,093-1,297 of 1,979 TFLOPS on H800
BASE_ATTN_MFU = 0.4  # MLA attention (FlashMLA decode reaches 580 of 989 TFLOPS, prefill less)


@dataclass(frozen=True)
class Deployment:
    name: str
    source: str
    phase: str  # prefill | decode
    accelerator: str
    published_tok_s: float
    per: str = "node"  # the published figure's unit: per node (gpus_per_node GPUs) or per gpu
    num_accelerators: int = 8  # GPUs of one simulated worker (attention data-parallel)
    gpus_per_node: int = 8
    ep_size: int = 8
    num_redundant_experts: int = 0
    node_dedup: bool = False  # DeepEP normal kernels (prefill): one NIC copy per remote node
    overlap: float = 1.0  # share of min(compute, all-to-all) the pipeline hides
    # the framework's own published speed-up of its micro-batch overlap over running without
    # it at the same tokens per GPU; when given, `overlap` is derived from it (see `predict`)
    overlap_speedup: float | None = None
    expert_dtype: str | None = None
    dispatch_bytes_per_value: float | None = None
    ep_collective: str = "all-to-all"
    prompt_len: int = 4096  # prefill: prompt tokens; decode: KV tokens per sequence
    tokens_per_gpu: int = 0  # prefill
    seqs_per_gpu: int = 0  # decode
    mtp_draft_tokens: int = 0
    mtp_acceptance: float = 0.0
    expert_load: ExpertLoadSpec | None = None  # None: every EP rank at the mean load
    imbalance_steps: int = 8
    settings: str = ""  # the post's own words for the setting

    def __post_init__(self) -> None:
        if self.phase not in ("prefill", "decode"):
            raise ValueError(f"{self.name}: phase must be prefill or decode")
        if self.per not in ("node", "gpu"):
            raise ValueError(f"{self.name}: per must be node or gpu")
        batch = self.tokens_per_gpu if self.phase == "prefill" else self.seqs_per_gpu
        if batch < 1 or self.prompt_len < 1 or not self.published_tok_s > 0:
            raise ValueError(f"{self.name}: batch, prompt_len and the published figure must "
                             "be positive")
        if not 0 <= self.mtp_acceptance <= 1 or self.mtp_draft_tokens < 0:
            raise ValueError(f"{self.name}: MTP acceptance must be in [0, 1]")
        if self.overlap_speedup is not None and not self.overlap_speedup >= 1:
            raise ValueError(f"{self.name}: overlap_speedup must be >= 1")


@dataclass(frozen=True)
class Prediction:
    name: str
    published_tok_s: float
    predicted_tok_s: float  # in the published unit (per node or per GPU)
    step_ms: float
    imbalance: float  # max / mean rank load of the routed experts (1: balanced)
    overlap: float  # share of min(compute, all-to-all) hidden
    breakdown_ms: dict = field(default_factory=dict)
    efficiency_scale: float = 1.0

    @property
    def ratio(self) -> float:
        return self.predicted_tok_s / self.published_tok_s

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "error": self.ratio - 1.0}


def roofline_config(dep: Deployment, efficiency_scale: float,
                    overlap: float | None = None) -> RooflineConfig:
    return RooflineConfig(
        num_accelerators=dep.num_accelerators, ep_size=dep.ep_size,
        mfu=BASE_MFU / efficiency_scale, attn_mfu=BASE_ATTN_MFU / efficiency_scale,
        num_redundant_experts=dep.num_redundant_experts, node_dedup=dep.node_dedup,
        overlap=dep.overlap if overlap is None else overlap, expert_dtype=dep.expert_dtype,
        dispatch_bytes_per_value=dep.dispatch_bytes_per_value, ep_collective=dep.ep_collective,
        mtp_draft_tokens=dep.mtp_draft_tokens if dep.phase == "decode" else 0)


def overlap_from_speedup(parts: dict[str, float], speedup: float) -> float:
    """The overlap share at which hiding `overlap · min(compute, comm)` speeds the serial
    step (compute + comm) up by `speedup` (clamped to [0, 1])."""
    compute, comm = parts["linear"] + parts["attention"], parts["all_to_all"]
    shorter = min(compute, comm)
    if shorter <= 0:
        return 0.0
    serial = compute + comm + parts["overhead"]
    return min(1.0, max(0.0, serial * (1.0 - 1.0 / speedup) / shorter))


def batch_chunks(dep: Deployment) -> tuple[list[ChunkShape], float]:
    """(the worker's step, the tokens it delivers: prompt tokens, or output tokens)."""
    g = dep.num_accelerators
    if dep.phase == "prefill":
        total = dep.tokens_per_gpu * g
        full, rest = divmod(total, dep.prompt_len)
        chunks = [ChunkShape(0, dep.prompt_len)] * full + ([ChunkShape(0, rest)] if rest else [])
        return chunks, float(total)
    rows = dep.seqs_per_gpu * g  # MTP's extra query tokens per row: RooflineConfig
    chunks = [ChunkShape(dep.prompt_len, 1)] * rows
    return chunks, rows * (1.0 + dep.mtp_acceptance * dep.mtp_draft_tokens)


def mean_imbalance(step: RooflineStepTime, dep: Deployment, group_tokens: float) -> float:
    """The routed pairs' max / mean rank load, pairs-weighted over `imbalance_steps` steps."""
    if dep.expert_load is None:
        return 1.0
    tracker = ExpertLoadTracker(dep.expert_load, step.ep_shape(), 0)
    return float(np.mean([tracker.step(group_tokens)[0] for _ in range(dep.imbalance_steps)]))


def predict(dep: Deployment, efficiency_scale: float = 1.0) -> Prediction:
    """The roofline's throughput for `dep`'s batch. With `overlap_speedup`, the overlap share
    is the one that gives that speed-up over the serial step at this very batch."""
    model, accel = analytic_model("deepseek-v3"), accelerator(dep.accelerator)
    step = RooflineStepTime(model, accel, roofline_config(dep, efficiency_scale, 0.0))
    chunks, delivered = batch_chunks(dep)
    group_tokens = sum(c.num_new_tokens for c in chunks) / dep.num_accelerators * dep.ep_size
    factor = mean_imbalance(step, dep, group_tokens)
    _, serial = step.step_time_with(chunks, factor)
    overlap = (dep.overlap if dep.overlap_speedup is None
               else overlap_from_speedup(serial, dep.overlap_speedup))
    step = RooflineStepTime(model, accel, roofline_config(dep, efficiency_scale, overlap))
    seconds, parts = step.step_time_with(chunks, factor)
    per_gpu = delivered / dep.num_accelerators / seconds
    per_unit = per_gpu * (dep.gpus_per_node if dep.per == "node" else 1)
    return Prediction(dep.name, dep.published_tok_s, per_unit, 1e3 * seconds, factor, overlap,
                      {k: 1e3 * v for k, v in parts.items()}, efficiency_scale)


def solve_scale(dep: Deployment) -> float:
    """The efficiency scale at which `dep` is predicted exactly (bisection on a log scale;
    throughput falls monotonically as the scale grows)."""
    lo, hi = 0.6, 8.0  # mfu = 0.6 / scale must stay <= 1
    if predict(dep, hi).ratio > 1 or predict(dep, lo).ratio < 1:
        raise ValueError(f"{dep.name}: no efficiency scale in [{lo}, {hi}] reproduces it")
    for _ in range(50):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if predict(dep, mid).ratio > 1 else (lo, mid)
    return math.sqrt(lo * hi)


def calibrate(calibration: list[Deployment]) -> dict:
    """The frozen efficiency scale: geometric mean of each calibration deployment's own."""
    scales = {d.name: solve_scale(d) for d in calibration}
    return {"per_deployment": scales,
            "efficiency_scale": float(math.exp(np.mean(np.log(list(scales.values())))))}


def with_expert_load(deps: list[Deployment], spec: ExpertLoadSpec | None) -> list[Deployment]:
    return [replace(d, expert_load=spec) for d in deps]
