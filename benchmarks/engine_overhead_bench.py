"""Host overhead per engine step: offline generation through `LLMEngine.step`, each
decode step split into the model forward, the logits, sampling, and the host work around them
(scheduler, step preparation, output processing).

    .venv/bin/python benchmarks/engine_overhead_bench.py --threads 2 \\
        --before /tmp/perfstep_before --json benchmarks/results/engine_overhead.json

`--stand-in-model` replaces the model by one that does no work (hidden states of zeros,
fixed logits), so the steps are the engine's host work alone: scheduler, step preparation,
sampling over a real vocabulary, detokenisation and outputs, measured without model noise.

Cases: batch-1 (16-token prompt, 128 out, greedy) and W1 (64 x 256 in / 128 out, greedy,
ignore EOS). Each (tree, case) runs in its own process (`PYTHONPATH=<tree>` for `--before`),
trees alternating over `--rounds`; a round's numbers are medians over its decode steps (steps
that only decode). `host` = step - forward - logits: everything the engine does per step
besides the model itself. Wall ms and process CPU ms (both threads summed) are reported: on a
shared box CPU ms are what the step costs, wall ms what it took.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = {"b1": (1, 16, 128), "w1": (64, 256, 128)}  # batch, input tokens, output tokens
PARTS = ["step", "forward", "logits", "sample", "schedule", "update", "process", "host"]


def stand_in_llm(threads: int):
    """An LLM whose model is a stand-in (zeros for hidden states, fixed logits): every step
    is host work only, so `host` is measured without the model's noise."""
    import torch

    from deepinfer.engine.engine_config import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.llm import LLM
    from deepinfer.runtime.model_source import resolve_model

    class StandIn(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.logits = torch.randn(64, config.vocab_size, generator=torch.Generator().manual_seed(0))

        def forward(self, input_ids, positions, attn, input_embeds=None):
            return torch.zeros(input_ids.shape[0], 8)

        def compute_logits(self, hidden):
            return self.logits[:hidden.shape[0]].clone()

    source = resolve_model(None)
    config = EngineConfig(dtype="bfloat16", device="cpu", kv_cache_memory="1GiB", num_threads=threads)
    return LLM.from_engine(LLMEngine(config, source=source, model=StandIn(source.config)))


def run_child(case: str, threads: int, output_len: int | None, stand_in: bool = False) -> dict:
    import torch

    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    batch, input_len, out_len = CASES[case]
    out_len = output_len or out_len
    if stand_in:
        llm = stand_in_llm(threads)
    else:
        llm = LLM(dtype="bfloat16", device="cpu", kv_cache_memory="1GiB", num_threads=threads)
    engine = llm.engine
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 30000 + 5 for j in range(input_len)]}
               for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)

    acc: dict[str, list[float]] = {}  # part -> [wall, cpu] of the current step

    def timed(part, fn):
        def call(*a, **k):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                slot = acc.setdefault(part, [0.0, 0.0])
                slot[0] += time.perf_counter() - w
                slot[1] += time.process_time() - c
        return call

    decode_only = []

    def schedule(now, _fn=engine.scheduler.schedule):
        out = _fn(now)
        decode_only.append(bool(out.scheduled) and all(len(s.token_ids) == 1 for s in out.scheduled))
        return out

    engine.scheduler.schedule = timed("schedule", schedule)
    engine.scheduler.update = timed("update", engine.scheduler.update)
    engine._process = timed("process", engine._process)
    engine.model.forward = timed("forward", engine.model.forward)
    engine.model.compute_logits = timed("logits", engine.model.compute_logits)
    engine.runner.sampler.sample = timed("sample", engine.runner.sampler.sample)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p["prompt_token_ids"], params)
    steps = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        acc.clear()
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        acc["step"] = [time.perf_counter() - w, time.process_time() - c]
        if decode_only[-1]:
            steps.append({k: v[:] for k, v in acc.items()})
    elapsed = time.perf_counter() - t0
    out = {"case": case, "stand_in_model": stand_in, "batch": batch, "input_len": input_len, "output_len": out_len,
           "elapsed_s": elapsed, "output_tok_s": batch * out_len / elapsed,
           "num_decode_steps": len(steps), "threads": threads}
    for kind, j in (("wall_ms", 0), ("cpu_ms", 1)):
        med = {}
        for part in PARTS[:-1]:
            med[part] = statistics.median(s.get(part, [0.0, 0.0])[j] for s in steps) * 1e3
        med["host"] = statistics.median(
            (s["step"][j] - s.get("forward", [0, 0])[j] - s.get("logits", [0, 0])[j]) for s in steps) * 1e3
        out[kind] = med
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None, help="a checkout of the tree to compare against")
    ap.add_argument("--cases", default="b1,w1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=None, help="override the cases' output length")
    ap.add_argument("--stand-in-model", action="store_true",
                    help="a stand-in model (no forward work): host overhead alone, low noise")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, args.threads, args.output_len,
                                               args.stand_in_model)), flush=True)
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"after": here}
    if args.before:
        trees = {"before": os.path.abspath(args.before), "after": here}
    results: dict[str, dict[str, list[dict]]] = {t: {} for t in trees}
    load = []
    for _ in range(args.rounds):
        for case in args.cases.split(","):
            for name, tree in trees.items():  # alternate trees inside each round
                cmd = [sys.executable, os.path.abspath(__file__), "--child", case,
                       "--threads", str(args.threads)]
                if args.output_len:
                    cmd += ["--output-len", str(args.output_len)]
                if args.stand_in_model:
                    cmd.append("--stand-in-model")
                env = dict(os.environ, PYTHONPATH=tree)
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    sys.exit(f"{name} {case} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                res = json.loads(line[len("RESULT "):])
                results[name].setdefault(case, []).append(res)
                load.append(os.getloadavg()[0])
                print(f"{name:6s} {case}: {res['output_tok_s']:7.1f} out tok/s  "
                      + "  ".join(f"{p} {res['cpu_ms'][p]:.2f}" for p in PARTS) + "  (cpu ms/step)",
                      flush=True)
    summary = {}
    for name, cases in results.items():
        for case, runs in cases.items():
            best = {kind: {p: min(r[kind][p] for r in runs) for p in PARTS} for kind in ("wall_ms", "cpu_ms")}
            summary.setdefault(name, {})[case] = {
                "best_output_tok_s": max(r["output_tok_s"] for r in runs), **best, "runs": runs}
    print("\nbest round per tree (ms per decode step; host = step - forward - logits)")
    for case in args.cases.split(","):
        for name in trees:
            s = summary[name][case]
            print(f"{case} {name:6s} out tok/s {s['best_output_tok_s']:7.1f} | wall "
                  + " ".join(f"{p} {s['wall_ms'][p]:.2f}" for p in PARTS) + " | cpu "
                  + " ".join(f"{p} {s['cpu_ms'][p]:.2f}" for p in PARTS))
    print(f"load average during the runs: {min(load):.1f} .. {max(load):.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trees": trees, "threads": args.threads, "output_len": args.output_len,
                       "stand_in_model": args.stand_in_model, "command": " ".join(sys.argv),
                       "load_average": [min(load), max(load)], "results": summary}, f, indent=2)


if __name__ == "__main__":
    main()
