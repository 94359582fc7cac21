"""Step-time models the simulator puts in place of the model runner. Pure.

A step-time model answers `step_time_s(chunks)` for the batch a scheduler produced, and knows
`kv_bytes_per_token` (for KV transfers and store loads). Two kinds:

  ProfileStepTime    a measured cost profile (`deepinfer profile` JSON, the engine's own
                     `core.cost_model.CostModel`), optionally scaled, plus the engine loop's
                     measured host work per step (`HostOverhead`) when the profile has it
  RooflineStepTime   an analytic accelerator + model description (`sim.roofline`)
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from deepinfer.core.cost_model import ChunkShape, CostModel, StepSample
from deepinfer.core.model_shape import ModelShape


class StepTimeModel(Protocol):
    kv_bytes_per_token: int
    publish_s_per_byte: float  # prefill work per KV byte written to the store (0: none)

    def step_time_s(self, chunks: Sequence[ChunkShape]) -> float: ...


@dataclass(frozen=True)
class HostOverhead:
    """Engine-loop time per step outside the model runner (scheduling, output processing,
    detokenisation, encoding the step's outputs): `per_step_s + per_request_s · requests`,
    as `deepinfer profile` measured it (profile metadata `host_overhead`)."""

    per_step_s: float = 0.0
    per_request_s: float = 0.0

    def __post_init__(self) -> None:
        if self.per_step_s < 0 or self.per_request_s < 0:
            raise ValueError("host overhead must be >= 0")

    @classmethod
    def from_metadata(cls, metadata: dict) -> "HostOverhead":
        data = metadata.get("host_overhead") or {}
        return cls(float(data.get("per_step_s", 0.0)), float(data.get("per_request_s", 0.0)))

    def seconds(self, num_requests: int) -> float:
        return self.per_step_s + self.per_request_s * num_requests


class ProfileStepTime:
    """A measured profile: step time = the cost model's prediction × `time_scale` + the
    engine loop's host work for that many requests (not scaled: it is host CPU time)."""

    def __init__(self, cost_model: CostModel, time_scale: float = 1.0,
                 host: HostOverhead | None = None) -> None:
        if not time_scale > 0:
            raise ValueError("time_scale must be positive")
        self.cost_model = cost_model
        self.time_scale = time_scale
        self.host = host if host is not None else HostOverhead.from_metadata(cost_model.metadata)
        self.kv_bytes_per_token = cost_model.shape.kv_bytes_per_token
        # CPU seconds per KV byte a prefill worker spends publishing blocks to the store.
        publish = cost_model.metadata.get("store_publish") or {}
        self.publish_s_per_byte = float(publish.get("s_per_byte", 0.0))

    def step_time_s(self, chunks: Sequence[ChunkShape]) -> float:
        if not chunks:
            return 0.0
        return self.cost_model.predict(chunks) * self.time_scale + self.host.seconds(len(chunks))


def load_cost_profile(path: str) -> CostModel:
    """A `deepinfer profile` JSON as the engine's CostModel (ValueError when unreadable)."""
    try:
        with open(os.path.expanduser(path)) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read cost profile {path}: {e}") from None
    return CostModel.from_dict(data)


def refit_on_cpu_time(model: CostModel) -> CostModel:
    """The profile refitted on its steps' CPU seconds instead of their wall seconds (same
    regimes, same metadata): the work of each step, less moved by other processes' load than
    wall time is. For a one-thread engine on a shared host, this predicts what its process's
    CPU seconds will be. ValueError when the profile has no CPU times (older profiles)."""
    samples = model.metadata.get("samples") or []
    if not samples or any("cpu_s" not in s for s in samples):
        raise ValueError("the profile has no per-step CPU times (measured before they were "
                         "recorded)")
    steps = [StepSample(tuple(ChunkShape(p, x) for p, x in s["chunks"]), float(s["cpu_s"]))
             for s in samples if s["chunks"] and s["cpu_s"] > 0]
    rows = model.metadata.get("small_decode_rows") or (
        model.small_decode.max_rows if model.small_decode is not None else None)
    refit = CostModel.fit_piecewise(model.shape, steps, rows,
                                    metadata={**model.metadata, "clock": "cpu"})
    refit.holdout_error = None  # the wall-time fit's hold-out does not describe this fit
    return refit


def fitted_cost_model(step_model: StepTimeModel, shape: ModelShape) -> CostModel:
    """The engine's CostModel fitted to an analytic step-time model over a grid of batches,
    so compute-aware budgets and the prefill router can use it as they use a profile."""
    samples = []
    for x in (16, 128, 512, 2048, 8192):
        for p in (0, 2048, 8192):
            samples.append(StepSample((ChunkShape(p, x),), step_model.step_time_s([ChunkShape(p, x)])))
    for b in (1, 16, 64, 256, 1024):
        for c in (512, 4096):
            batch = tuple(ChunkShape(c, 1) for _ in range(b))
            samples.append(StepSample(batch, step_model.step_time_s(batch)))
    return CostModel.fit(shape, samples, metadata={"fitted_to": "roofline"})


def build_step_time(cost) -> tuple[StepTimeModel, CostModel]:
    """(step-time model, the engine's CostModel for budgets and routing) for a `CostSpec`."""
    if cost.profile is not None:
        model = load_cost_profile(cost.profile)
        return ProfileStepTime(model, cost.time_scale), model
    from deepinfer.sim.analytic_model import analytic_model
    from deepinfer.sim.hardware import accelerator
    from deepinfer.sim.roofline import RooflineStepTime
    spec = analytic_model(cost.model)
    step = RooflineStepTime(spec, accelerator(cost.accelerator), cost.roofline)
    return step, fitted_cost_model(step, spec.model_shape())
