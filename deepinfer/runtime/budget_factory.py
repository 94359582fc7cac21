"""Build the engine's step-budget policy from its config: token budget or compute-aware.

Compute-aware needs a cost model of this model on this device. It comes from, in order:
`--cost-profile PATH` (a profile JSON from `deepinfer profile`), else a cached start-up
profile for (model shape, dtype, device, threads), else a quick profile measured now on the
engine's own runner (seconds) and cached under ~/.cache/deepinfer/profiles
(`DEEPINFER_PROFILE_DIR` overrides the folder).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re

import torch

from deepinfer.core.compute_budget import ComputeAwarePolicy
from deepinfer.core.cost_model import ChunkShape, CostModel
from deepinfer.core.model_shape import ModelShape
from deepinfer.core.step_budget import StepBudgetPolicy, TokenBudgetPolicy
from deepinfer.runtime.profiler import GRID_VERSION, QUICK_GRID, device_name, profile_cost_model

logger = logging.getLogger(__name__)

POLICY_KINDS = ("token-budget", "compute-aware")
MIN_CHUNK_TOKENS = 32


def build_step_budget_policy(kind: str, *, max_num_batched_tokens: int,
                             step_time_budget_ms: float | None, cost_profile_path: str | None,
                             runner, model_config, block_size: int, dtype: str
                             ) -> StepBudgetPolicy:
    """The policy the engine's scheduler fills each step with.

    compute-aware: each step's predicted time stays within `step_time_budget_ms` (default: the
    predicted time of one `max_num_batched_tokens`-token prefill chunk, i.e. what a token-budget
    step of that size costs); chunks are block-aligned; the first prefill chunk of a step gets
    at least `MIN_CHUNK_TOKENS` (rounded up to whole blocks); `max_num_batched_tokens` still caps
    the tokens of a step (activation memory). Raises ValueError for an unknown kind, a bad
    budget or an unreadable profile.
    """
    if kind == "token-budget":
        return TokenBudgetPolicy(max_num_batched_tokens)
    if kind != "compute-aware":
        raise ValueError(f"unknown scheduler policy {kind!r}; choose one of {POLICY_KINDS}")
    if step_time_budget_ms is not None and not step_time_budget_ms > 0:
        raise ValueError(f"step_time_budget_ms must be positive, got {step_time_budget_ms}")
    dtype_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    shape = ModelShape.from_model_config(model_config, dtype_bytes)
    if cost_profile_path:
        cost_model = load_cost_profile(cost_profile_path, shape)
    else:
        cost_model = cached_startup_profile(runner, shape, model_config.vocab_size, dtype)
    if step_time_budget_ms is None:
        budget_s = cost_model.predict([ChunkShape(0, max_num_batched_tokens)])
    else:
        budget_s = step_time_budget_ms / 1000.0
    min_chunk = -(-MIN_CHUNK_TOKENS // block_size) * block_size
    logger.info("compute-aware scheduling: step time budget %.1f ms, min chunk %d tokens",
                budget_s * 1e3, min_chunk)
    return ComputeAwarePolicy(cost_model, budget_s, block_size=block_size,
                              min_chunk_tokens=min_chunk,
                              max_num_batched_tokens=max_num_batched_tokens)


def load_cost_profile(path: str, shape: ModelShape | None = None) -> CostModel:
    """Read a profile JSON. With `shape`, its coefficients (seconds per FLOP / byte / request /
    step) are applied to that model shape; a profile of another shape is used with a warning."""
    try:
        with open(os.path.expanduser(path)) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read cost profile {path}: {e}") from None
    model = CostModel.from_dict(data)
    if shape is None or shape == model.shape:
        return model
    logger.warning("cost profile %s was measured for another model shape; using its "
                   "per-FLOP/per-byte coefficients for this model", path)
    return model.with_shape(shape)  # keeps the small-decode regime


def profile_cache_dir() -> str:
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                           "deepinfer", "profiles")
    return os.environ.get("DEEPINFER_PROFILE_DIR", default)


def profile_cache_path(shape: ModelShape, dtype: str, device: torch.device) -> str:
    """One file per (model shape, dtype, device, threads, grid version)."""
    shape_key = hashlib.sha256(json.dumps(shape.to_dict(), sort_keys=True).encode()).hexdigest()
    device_key = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name(device))
    name = (f"shape-{shape_key[:12]}-{dtype}-{device_key}-t{torch.get_num_threads()}"
            f"-g{GRID_VERSION}.json")
    return os.path.join(profile_cache_dir(), name)


def cached_startup_profile(runner, shape: ModelShape, vocab_size: int, dtype: str) -> CostModel:
    path = profile_cache_path(shape, dtype, runner.device)
    if os.path.isfile(path):
        try:
            model = load_cost_profile(path, shape)
            logger.info("cost profile from cache: %s", path)
            return model
        except ValueError as e:
            logger.warning("ignoring unreadable cached profile: %s", e)
    logger.info("profiling step costs (quick grid) for compute-aware scheduling ...")
    model = profile_cost_model(runner, shape, vocab_size, QUICK_GRID, metadata={"dtype": dtype})
    err = model.holdout_error
    logger.info("cost profile: held-out median error %.1f%%, p90 %.1f%%; cached at %s",
                err.median_abs_pct_error, err.p90_abs_pct_error, path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(model.to_dict(), f, indent=1)
        os.replace(tmp, path)  # atomic: concurrent engines never read half a file
    except OSError as e:
        logger.warning("could not cache the cost profile at %s: %s", path, e)
    return model
