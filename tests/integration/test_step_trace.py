"""`deepinfer bench offline --profile`: torch.profiler traces of representative engine steps
(runtime/step_trace.py), on the session's fp32 engine and as a user runs the CLI."""
from __future__ import annotations

import json

import pytest

from deepinfer import SamplingParams
from deepinfer.core.scheduler_output import ScheduledRequest, SchedulerOutput
from deepinfer.runtime.step_trace import StepTrace, TraceWindow, format_top_ops, step_kind
from tests.integration.test_cli import assert_one_line_error, run_cli


def _req(num_new: int, num_draft: int = 0) -> ScheduledRequest:
    return ScheduledRequest("r", [5] * num_new, 0, [0], True, SamplingParams(), 0,
                            num_draft_tokens=num_draft)


def test_step_kind_separates_prefill_decode_and_speculative_decode():
    assert step_kind(SchedulerOutput([], 0)) is None
    assert step_kind(SchedulerOutput([_req(1), _req(1)], 2)) == "decode"
    assert step_kind(SchedulerOutput([_req(1), _req(7)], 8)) == "prefill"
    assert step_kind(SchedulerOutput([_req(5, num_draft=4)], 5)) == "decode"


def test_a_window_cut_short_by_another_step_kind_does_not_reopen(tmp_path):
    import torch

    def execute(output):  # stands in for the runner: one real op per step
        return torch.ones(4, 4) @ torch.ones(4, 4)

    trace = StepTrace(str(tmp_path), decode_steps=3, decode_warmup=1)
    traced = trace.wrap(execute)
    prefill, decode = SchedulerOutput([_req(6)], 6), SchedulerOutput([_req(1), _req(1)], 2)
    for out in (prefill, decode, decode, prefill, decode, decode):
        traced(out)
    windows = {w.name: w for w in trace.close()}
    assert windows["prefill"].num_recorded == 1
    # warm-up 1, recorded 1, then a prefill step closed the window: later decodes stay out.
    assert windows["decode"].num_recorded == 1 and windows["decode"].batch_sizes == [2]
    names = _assert_valid_trace(windows["decode"].trace_path)
    assert "deepinfer_step[decode]" in names


def test_top_ops_table_orders_by_cpu_or_gpu_time_per_step():
    ops = [{"name": "aten::mm", "count": 4, "self_cpu_us": 1000.0, "self_device_us": 8000.0},
           {"name": "aten::copy_", "count": 4, "self_cpu_us": 3000.0, "self_device_us": 10.0}]
    w = TraceWindow("decode", 2, num_recorded=2, batch_sizes=[8, 8], ops=ops, trace_path="t.json")
    by_cpu = format_top_ops(w).splitlines()
    assert by_cpu[2].startswith("aten::copy_") and "1.500" in by_cpu[2] and "75.0%" in by_cpu[2]
    by_gpu = format_top_ops(w, by="self_device_us").splitlines()
    assert by_gpu[2].startswith("aten::mm") and by_gpu[2].rstrip().endswith("4.000")


def _assert_valid_trace(path: str) -> set[str]:
    with open(path) as f:
        trace = json.load(f)  # valid JSON (Chrome trace format)
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
    return names


@pytest.mark.slow
def test_step_trace_records_first_prefill_and_decodes_after_warmup(engine_base_llm, tmp_path):
    llm = engine_base_llm
    runner = llm.engine.runner
    trace = StepTrace(str(tmp_path), decode_steps=3, decode_warmup=2)
    runner.execute = trace.wrap(runner.execute)
    try:
        prompts = [{"prompt_token_ids": list(range(300 + i, 340 + i))} for i in range(2)]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        del runner.execute
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    windows = {w.name: w for w in trace.close()}
    assert set(windows) == {"prefill", "decode"}
    assert windows["prefill"].num_recorded == 1
    # 2 decode steps pass as warm-up, the next 3 are recorded (both requests decode together).
    assert windows["decode"].batch_sizes == [2, 2, 2]
    for w in windows.values():
        names = _assert_valid_trace(w.trace_path)
        assert f"deepinfer_step[{w.name}]" in names
        with open(w.ops_path) as f:
            ops = json.load(f)["ops"]
        assert ops and ops[0]["self_cpu_us"] >= ops[-1]["self_cpu_us"]
        table = format_top_ops(w, top=10)
        assert any(line.startswith(("aten::", "mkldnn::")) for line in table.splitlines()), table
    # The decode window's linears run as real ops, not only our step label.
    assert any("linear" in r["name"] or "mm" in r["name"] for r in windows["decode"].ops)


@pytest.mark.slow
def test_bench_offline_profile_writes_traces_and_prints_top_ops(tmp_path):
    out = tmp_path / "prof"
    result = run_cli("bench", "offline", "--num-prompts", "2", "--input-len", "24",
                     "--output-len", "10", "--dtype", "float32", "--kv-cache-memory", "64MiB",
                     "--profile", str(out), "--profile-decode-steps", "2",
                     "--json", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[prefill] 1 step(s)" in result.stdout and "[decode] 2 step(s)" in result.stdout
    assert "aten::" in result.stdout
    for name in ("prefill", "decode"):
        _assert_valid_trace(str(out / f"{name}_trace.json"))
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["profile"]["decode"]["num_steps"] == 2


def test_bench_offline_bad_profile_flags_exit_2(tmp_path):
    import argparse

    from deepinfer.bench.errors import BenchError
    from deepinfer.bench.offline import _step_trace

    (tmp_path / "file").write_text("x")
    assert_one_line_error(run_cli("bench", "offline", "--profile", str(tmp_path / "file")))
    args = argparse.Namespace(profile_dir=str(tmp_path / "d"), profile_decode_steps=0)
    with pytest.raises(BenchError, match="--profile-decode-steps must be positive"):
        _step_trace(args, None)  # the same BenchError -> one-line exit 2 as above
