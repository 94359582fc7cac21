"""EPLB settings, vLLM's `--eplb-config` JSON: plain data, validated on construction."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EPLBConfig:
    window_size: int = 1000  # steps of load history the planner sees
    step_interval: int = 3000  # rebalance every this many steps (of the whole EP group)
    num_redundant_experts: int = 0  # extra physical slots per MoE layer (replicas of hot experts)
    log_balancedness: bool = False  # log every step's group-wide balancedness (one more all-reduce)
    # DeepInfer: a scheduled rebalance agrees on the window at the due step, plans in a
    # background thread and moves at least this many group steps later, once every rank's plan
    # is done (0: plan at the due step, stalling it; -1: auto, step_interval // 4 capped at 64).
    # Forced rebalances always plan at once.
    plan_ahead_steps: int = -1

    @property
    def plan_ahead(self) -> int:
        if self.plan_ahead_steps >= 0:
            return self.plan_ahead_steps
        return min(64, self.step_interval // 4)

    def __post_init__(self) -> None:
        if self.window_size < 1 or self.step_interval < 1:
            raise ValueError("eplb window_size and step_interval must be >= 1")
        if self.num_redundant_experts < 0:
            raise ValueError("eplb num_redundant_experts must be >= 0")
        if self.plan_ahead_steps < -1:
            raise ValueError("eplb plan_ahead_steps must be >= 0 (or -1: auto)")

    @classmethod
    def from_json(cls, text: str | None) -> EPLBConfig:
        """From `--eplb-config '{"window_size": ..}'`; ValueError (one line) on bad input."""
        if not text:
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--eplb-config is not valid JSON: {e.msg}") from None
        if not isinstance(values, dict):
            raise ValueError("--eplb-config must be a JSON object")
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"--eplb-config: unknown keys {unknown}; known: {sorted(known)}")
        for key, value in values.items():
            want = bool if key == "log_balancedness" else int
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"--eplb-config: {key} must be {want.__name__}, got {value!r}")
        return cls(**values)
