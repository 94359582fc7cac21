"""Where a step's time goes: torch.profiler around a few representative engine steps.

Not to be confused with runtime/profiler.py, which measures step times to fit the scheduler's
*cost model*. This module records op-level traces for people to read:

    window "prefill": the first step that runs a prefill chunk (1 step)
    window "decode":  after `decode_warmup` pure-decode steps, the next `decode_steps` ones

Each window becomes `<name>_trace.json` (Chrome trace: chrome://tracing or ui.perfetto.dev) and
`<name>_ops.json` (torch's key_averages table as a list of rows) in the output directory.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from deepinfer.core.scheduler_output import SchedulerOutput


@dataclass
class TraceWindow:
    name: str
    num_steps: int  # steps to record
    num_skip: int = 0  # matching steps to let pass first (warm-up)
    num_seen: int = 0
    num_recorded: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    ops: list[dict] = field(default_factory=list)  # key_averages rows, filled when it closes
    trace_path: str | None = None  # set when the window closes (it never reopens)
    ops_path: str | None = None

    @property
    def done(self) -> bool:
        return self.num_recorded >= self.num_steps or self.trace_path is not None


def step_kind(output: SchedulerOutput) -> str | None:
    """'prefill' when any request runs a prompt chunk, 'decode' when all run one known token
    (plus its draft tokens under speculative decoding)."""
    if output.is_empty:
        return None
    decoding = all(r.num_new_tokens - r.num_draft_tokens == 1 for r in output.scheduled)
    return "decode" if decoding else "prefill"


class StepTrace:
    """Wraps a runner's `execute` and profiles the steps its windows select.

    Usage: `runner.execute = trace.wrap(runner.execute)`, run the workload, then `trace.close()`
    (also closes a window left open because the workload ended early)."""

    def __init__(self, out_dir: str, decode_steps: int = 8, decode_warmup: int = 4,
                 device: torch.device | None = None) -> None:
        if decode_steps < 1 or decode_warmup < 0:
            raise ValueError("decode_steps must be >= 1 and decode_warmup >= 0")
        self.out_dir = out_dir
        self.windows = {"prefill": TraceWindow("prefill", 1),
                        "decode": TraceWindow("decode", decode_steps, decode_warmup)}
        self.activities = [ProfilerActivity.CPU]
        self.on_cuda = device is not None and device.type == "cuda"
        if self.on_cuda:
            self.activities.append(ProfilerActivity.CUDA)
        self._open: tuple[TraceWindow, profile] | None = None

    def wrap(self, execute):
        def traced(output: SchedulerOutput):
            window = self.windows.get(step_kind(output))
            if self._open is not None and self._open[0] is not window:
                self._finish()  # a step of another kind ends the window (shorter than asked)
            if window is None or window.done or window.num_seen < window.num_skip:
                if window is not None:
                    window.num_seen += 1
                return execute(output)
            window.num_seen += 1
            if self._open is None:
                prof = profile(activities=self.activities)
                prof.start()
                self._open = (window, prof)
            with record_function(f"deepinfer_step[{window.name}]"):  # one key per window
                result = execute(output)
                if self.on_cuda:
                    torch.cuda.synchronize()
            window.num_recorded += 1
            window.batch_sizes.append(len(output.scheduled))
            if window.done:
                self._finish()
            return result
        return traced

    def close(self) -> list[TraceWindow]:
        """Writes any window still open; returns the windows that recorded something."""
        if self._open is not None:
            self._finish()
        return [w for w in self.windows.values() if w.num_recorded]

    def _finish(self) -> None:
        window, prof = self._open
        self._open = None
        prof.stop()
        os.makedirs(self.out_dir, exist_ok=True)
        window.trace_path = os.path.join(self.out_dir, f"{window.name}_trace.json")
        prof.export_chrome_trace(window.trace_path)
        window.ops = op_rows(prof, self.on_cuda)
        window.ops_path = os.path.join(self.out_dir, f"{window.name}_ops.json")
        with open(window.ops_path, "w") as f:
            json.dump({"window": window.name, "num_steps": window.num_recorded,
                       "batch_sizes": window.batch_sizes, "ops": window.ops}, f, indent=1)


def op_rows(prof: profile, on_cuda: bool) -> list[dict]:
    """key_averages as rows sorted by self CPU time (µs totals over the window's steps)."""
    rows = []
    for e in prof.key_averages():
        row = {"name": e.key, "count": e.count, "self_cpu_us": e.self_cpu_time_total,
               "cpu_total_us": e.cpu_time_total}
        if on_cuda:
            row["self_device_us"] = getattr(e, "self_device_time_total", 0.0)
            row["device_total_us"] = getattr(e, "device_time_total", 0.0)
        rows.append(row)
    rows.sort(key=lambda r: r["self_cpu_us"], reverse=True)
    return rows


def format_top_ops(window: TraceWindow, top: int = 15, by: str = "self_cpu_us") -> str:
    """A short table of the window's top ops by self CPU time (`by="self_device_us"`: by self
    GPU time; the GPU column is shown when the window recorded CUDA activity)."""
    steps = max(window.num_recorded, 1)
    total = sum(r["self_cpu_us"] for r in window.ops) or 1.0
    device = any("self_device_us" in r for r in window.ops)
    head = f"{'op':<44} {'calls':>7} {'self CPU ms/step':>17} {'share':>6}"
    if device:
        head += f" {'self GPU ms/step':>17}"
    order = "GPU" if by == "self_device_us" else "CPU"
    lines = [f"[{window.name}] {window.num_recorded} step(s), batch sizes {window.batch_sizes}, "
             f"self CPU {total / 1000 / steps:.2f} ms/step, top ops by self {order} time "
             f"-> {window.trace_path}", head]
    for r in sorted(window.ops, key=lambda r: r.get(by, 0.0), reverse=True)[:top]:
        line = (f"{r['name'][:44]:<44} {r['count']:>7} {r['self_cpu_us'] / 1000 / steps:>17.3f}"
                f" {100 * r['self_cpu_us'] / total:>5.1f}%")
        if device:
            line += f" {r.get('self_device_us', 0.0) / 1000 / steps:>17.3f}"
        lines.append(line)
    return "\n".join(lines)
