"""What frame authentication costs: W1 over HTTP against a P1/D1 cluster, alternating rounds
with the per-frame HMAC on (as shipped) and off (benchmark-only, `auth_off/sitecustomize.py`).

    .venv/bin/python benchmarks/auth_cost_bench.py --rounds 3 --json benchmarks/results/auth_cost.json

Each round starts `deepinfer serve --prefill-workers 1 --decode-workers 1` once with
authentication on and once off (the order flips every round), waits for /health, runs
`deepinfer bench serve` (W1: 32 random 256-token prompts, 128 output tokens, EOS ignored,
all at once; one warm-up pass first), and stops the server. Reported: output tok/s per round
and side, each round's off/on ratio and the median cost (1 - on/off).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_report import BenchReport  # noqa: E402
from server_health import wait_healthy  # noqa: E402

ROOT = HERE.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench(url: str, args, out: str, num_prompts: int) -> dict:
    cmd = [sys.executable, "-m", "deepinfer", "bench", "serve", "--base-url", url,
           "--workload", "random", "--num-prompts", str(num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--request-rate", "inf", "--seed", "0", "--json", out, "--no-progress"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(Path(out).read_text())


def run_side(auth: bool, args, workdir: str) -> float:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE / "auth_off"), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env["DEEPINFER_BENCH_AUTH_OFF"] = "0" if auth else "1"
    cmd = [sys.executable, "-m", "deepinfer", "serve", "--port", str(port),
           "--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "none",
           "--no-prefix-caching", "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, args.start_timeout)
        _bench(url, args, f"{workdir}/warmup.json", 8)
        result = _bench(url, args, f"{workdir}/{'on' if auth else 'off'}.json", args.num_prompts)
        return float(result["summary"]["output_throughput"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="per worker process")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    report = BenchReport()
    rates: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="auth-cost-") as workdir:
        for rnd in range(args.rounds):
            order = ("on", "off") if rnd % 2 == 0 else ("off", "on")
            for side in order:
                rates[side].append(run_side(side == "on", args, workdir))
                print(f"round {rnd} auth {side}: {rates[side][-1]:.1f} output tok/s",
                      file=sys.stderr, flush=True)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    result = {"workload": vars(args), "output_tok_s": rates, "on_over_off_per_round": ratios,
              "median_cost": 1.0 - statistics.median(ratios)}
    report.finish(result, args.json)
    print(json.dumps({"on_over_off_per_round": ratios, "median_cost": result["median_cost"]},
                     indent=2))


if __name__ == "__main__":
    main()
