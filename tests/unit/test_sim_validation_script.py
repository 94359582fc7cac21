"""benchmarks/sim_validation.py's per-worker accounting: the front's labelled counters are
parsed per worker and set beside the simulator's steps and work."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("sim_validation",
                                                  ROOT / "benchmarks" / "sim_validation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


METRICS = """\
# HELP deepinfer:cluster_engine_steps_total Engine steps run.
deepinfer:cluster_engine_steps_total{role="decode",worker_id="decode-0"} 120.0
deepinfer:cluster_engine_steps_total{role="prefill",worker_id="prefill-0"} 6.0
deepinfer:cluster_prefilled_requests_total{role="prefill",worker_id="prefill-0"} 2.0
deepinfer:cluster_prefill_computed_tokens_total{role="prefill",worker_id="prefill-0"} 300.0
deepinfer:cluster_model_step_seconds_total{role="decode",worker_id="decode-0"} 2.0
deepinfer:cluster_loop_step_seconds_total{role="decode",worker_id="decode-0"} 2.6
deepinfer:cluster_process_cpu_seconds_total{role="decode",worker_id="decode-0"} 3.0
deepinfer:cluster_kv_transfers_total{role="decode",worker_id="decode-0"} 7.0
deepinfer:cluster_request_retries_total 0.0
"""


def test_worker_counters_are_parsed_per_worker_and_compared(monkeypatch):
    sv = load_script()  # puts the repository on sys.path, as the script does
    from benchmarks.sim_validation_engine import worker_counters
    monkeypatch.setattr(httpx, "get", lambda url, timeout: SimpleNamespace(text=METRICS))
    counters = worker_counters(1234)
    assert counters == {"decode-0": {"engine_steps": 120.0, "model_step_seconds": 2.0,
                                     "loop_step_seconds": 2.6, "process_cpu_seconds": 3.0},
                        "prefill-0": {"engine_steps": 6.0, "prefilled_requests": 2.0,
                                      "prefill_computed_tokens": 300.0}}
    workers = [SimpleNamespace(worker_id="decode-0", num_steps=100, work_time_s=2.5),
               SimpleNamespace(worker_id="decode-1", num_steps=90, work_time_s=2.0),
               SimpleNamespace(worker_id="prefill-0", num_steps=5, work_time_s=1.0)]
    records = [SimpleNamespace(prefill_worker="prefill-0", prompt_len=200, num_cached_tokens=50),
               SimpleNamespace(prefill_worker="prefill-0", prompt_len=100, num_cached_tokens=None),
               SimpleNamespace(prefill_worker="prefill-1", prompt_len=400, num_cached_tokens=0)]
    sim_run = SimpleNamespace(simulator=SimpleNamespace(
        workers={w.worker_id: w for w in workers},
        requests={f"r{i}": r for i, r in enumerate(records)}))
    rows = sv.worker_breakdown(counters, sim_run)
    assert set(rows) == {"decode-0", "prefill-0"}  # decode-1 has no measurement
    # the prefill split next to the measured one (routing differences show here)
    assert rows["prefill-0"]["simulated_prefilled_requests"] == 2
    assert rows["prefill-0"]["simulated_prefill_computed_tokens"] == 150 + 100
    row = rows["decode-0"]
    assert row["simulated_steps"] == 100 and row["simulated_work_s"] == 2.5
    assert abs(row["measured_host_ms_per_step"] - 1e3 * 0.6 / 120) < 1e-9
    assert abs(row["cpu_vs_simulated_work"] - (3.0 / 2.5 - 1)) < 1e-9
