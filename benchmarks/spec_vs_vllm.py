"""Speculative decoding side by side: DeepInfer vs vLLM CPU, n-gram prompt lookup.

Same prompts, same weights, same run, batch 1, greedy:

* prompts: the code-editing chat requests of `spec_decode_bench.py` (its `code_tasks`: real
  functions of the Python standard library, "rename `x`" / "add type hints"), rendered with
  DeepInfer's chat template into token ids; both engines get those ids, so their inputs are
  identical (the vLLM worker also renders the template with its own tokenizer and reports
  whether the ids agree);
* model: SmolLM2-135M-Instruct. DeepInfer loads its embedded GGUF, vLLM the fp32 Hugging Face
  checkpoint `../shared/peers/setup.sh` dequantises from that same GGUF; both run in bf16;
* four engines, each loaded once: DeepInfer plain / ngram, vLLM plain / ngram (vLLM in
  long-lived worker subprocesses of its own venv). Requests go one at a time and the engines
  alternate request by request, so drift of a shared machine hits all four alike;
* speculation: `{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
  "prompt_lookup_max": 5}` on both;
* threads: `--threads N` intra-op threads on both (DeepInfer `num_threads`, vLLM
  `VLLM_CPU_OMP_THREADS_BIND` = cores 0..N-1). vLLM keeps its default front-end process
  beside the engine-core process; DeepInfer runs in one process.

Per request: output tokens / wall time of the single-request `generate` call (measured inside
each engine's own process, same definition for both), mean over prompts. Acceptance: DeepInfer's
engine stats, vLLM's `LLM.get_metrics()` counters (`vllm:spec_decode_*`).

    PEER_WORK=/tmp/peers .venv/bin/python benchmarks/spec_vs_vllm.py --threads 1 \\
        --json benchmarks/results/spec_vs_vllm.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}
TAG = "@@SPEC_VS_VLLM "  # marks the worker's replies among whatever vLLM prints to stdout


# ---------------------------------------------------------------- vLLM worker (vLLM's venv)

def vllm_counters(llm) -> dict:
    """Spec-decode counters from vLLM's in-process metrics; {} where the version has none."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # older versions / stats off: acceptance unknown, speed still measured
        return {}
    out = {}
    for m in metrics:
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            out[m.name.removeprefix("vllm:")] = m.value
    return out


def vllm_worker(model: str, spec: str, max_model_len: int) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=model, dtype="bfloat16", max_model_len=max_model_len, seed=0,
                  disable_log_stats=False)
    if spec:
        kwargs["speculative_config"] = json.loads(spec)
    llm = LLM(**kwargs)
    tok = llm.get_tokenizer()
    print(TAG + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"])
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt_token_ids"])], params,
                           use_tqdm=False)
        wall = time.perf_counter() - start
        text = tok.apply_chat_template(req["messages"], tokenize=False, add_generation_prompt=True)
        own = tok(text, add_special_tokens=False)["input_ids"]
        print(TAG + json.dumps({"token_ids": list(out[0].outputs[0].token_ids), "wall_s": wall,
                                "template_ids_equal": list(own) == req["prompt_token_ids"],
                                "counters": vllm_counters(llm)}), flush=True)
    return 0


class VllmEngine:
    """Parent-side handle on one vLLM worker subprocess: one request in, one reply out."""

    def __init__(self, python: str, model: str, spec: dict | None, threads: int,
                 max_model_len: int, log_path: str) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                   VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
                   TOKENIZERS_PARALLELISM="false")
        cmd = [python, os.path.abspath(__file__), "--vllm-worker", "--model", model,
               "--worker-spec", json.dumps(spec) if spec else "",
               "--max-model-len", str(max_model_len)]
        self.log = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self._reply()  # ready

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        raise RuntimeError(f"vLLM worker exited (rc={self.proc.wait()}); see {self.log.name}")

    def generate(self, token_ids: list[int], messages: list[dict], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"op": "gen", "prompt_token_ids": token_ids,
                                          "messages": messages, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# ---------------------------------------------------------------- DeepInfer side (project venv)

class DeepInferEngine:
    def __init__(self, llm) -> None:
        self.llm = llm

    def generate(self, token_ids: list[int], messages: list[dict], max_tokens: int) -> dict:
        from deepinfer import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        start = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)
        wall = time.perf_counter() - start
        from spec_decode_bench import spec_counters

        return {"token_ids": list(out[0].outputs[0].token_ids), "wall_s": wall,
                "counters": spec_counters(self.llm)}


class LoadSampler:
    """1-minute load average every few seconds while the measurement runs."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def summarise(replies: list[dict], before: dict, after: dict) -> dict:
    from spec_decode_bench import acceptance

    rates = [len(r["token_ids"]) / r["wall_s"] for r in replies]
    return {"num_requests": len(replies),
            "output_tokens": sum(len(r["token_ids"]) for r in replies),
            "mean_tok_s": statistics.fmean(rates), "median_tok_s": statistics.median(rates),
            "per_request_tok_s": rates, **acceptance(before, after)}


def worker_main() -> int:
    """In vLLM's venv (no DeepInfer imports): serve requests on stdin."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-worker", action="store_true")
    parser.add_argument("--worker-spec", default="")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    args = parser.parse_args()
    return vllm_worker(args.model, args.worker_spec, args.max_model_len)


def main() -> int:
    if "--vllm-worker" in sys.argv[1:]:
        return worker_main()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # the same prompts, flags and alternating loop as DeepInfer's own benchmark
    from spec_decode_bench import add_workload_args, alternate, code_tasks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer-work", default=os.environ.get("PEER_WORK", "/tmp/peers"),
                        help="where ../shared/peers/setup.sh built vLLM and the HF checkpoint")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=2048)
    add_workload_args(parser)
    args = parser.parse_args()
    if args.threads < 1:
        parser.error("--threads must be positive")
    vllm_python = os.path.join(args.peer_work, "vllm", "bin", "python")
    hf_model = os.path.join(args.peer_work, "models", "hf")
    if not (os.path.exists(vllm_python) and os.path.exists(os.path.join(hf_model, "config.json"))):
        parser.error(f"no vLLM venv / HF checkpoint in {args.peer_work}: run "
                     f"PEER_WORK={args.peer_work} ../shared/peers/setup.sh first")

    from deepinfer import LLM

    common = dict(dtype="bfloat16", kv_cache_memory="1GiB", num_threads=args.threads, seed=0)
    base = LLM(None, **common)
    spec = LLM(None, share_weights_with=base, speculative_config=NGRAM, **common)
    # one task more than measured: the last warms every engine up without priming a prefix hit
    tasks = code_tasks(args.num_prompts + 1, args.seed, args.min_lines, args.max_lines)
    tok = base.get_tokenizer()
    prompts = []
    for conv in tasks:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        prompts.append((tok(text, add_special_tokens=False).input_ids, conv))
    log_dir = os.path.join(args.peer_work, "results")
    os.makedirs(log_dir, exist_ok=True)
    engines = {"deepinfer_plain": DeepInferEngine(base), "deepinfer_ngram": DeepInferEngine(spec)}
    try:
        for name, cfg in (("vllm_plain", None), ("vllm_ngram", NGRAM)):
            engines[name] = VllmEngine(vllm_python, hf_model, cfg, args.threads, args.max_model_len,
                                       os.path.join(log_dir, f"spec_vs_vllm_{name}.log"))
        warm = {name: e.generate(*prompts[-1], args.max_tokens) for name, e in engines.items()}

        def progress(i: int, replies: dict) -> None:
            rates = (f"{n} {len(r[-1]['token_ids']) / r[-1]['wall_s']:.1f}"
                     for n, r in replies.items())
            print(f"prompt {i}: " + ", ".join(rates), flush=True)

        load_before = os.getloadavg()
        with LoadSampler() as load:  # batch 1: the four engines alternate prompt by prompt
            replies = alternate({name: (lambda a, b, e=e: [e.generate(*p, args.max_tokens)
                                                           for p in prompts[a:b]])
                                 for name, e in engines.items()},
                                len(prompts) - 1, 1, progress)
        load_after = os.getloadavg()
    finally:
        for e in engines.values():
            if isinstance(e, VllmEngine):
                e.close()

    results = {name: summarise(replies[name], warm[name]["counters"], replies[name][-1]["counters"])
               for name in engines}
    ref = replies["deepinfer_plain"]
    for name in engines:
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(ref, replies[name]))
        results[name]["outputs_equal_to_deepinfer_plain"] = f"{same}/{len(ref)}"
    vref = replies["vllm_plain"]
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(vref, replies["vllm_ngram"]))
    results["vllm_ngram"]["outputs_equal_to_vllm_plain"] = f"{same}/{len(vref)}"
    template_equal = all(r.get("template_ids_equal") for r in replies["vllm_plain"])

    print(f"\nSmolLM2-135M-Instruct bf16, batch 1, greedy, {args.max_tokens} max tokens, "
          f"{args.threads} thread(s) each, {args.num_prompts} code-edit prompts")
    print(f"{'engine':18s} {'mean tok/s':>10s} {'median':>8s} {'acc. len':>8s} {'acc. rate':>9s} "
          f"{'= DI plain':>10s}")
    for name, r in results.items():
        acc_len, acc_rate = r.get("mean_acceptance_length"), r.get("acceptance_rate")
        acc_len = "-" if acc_len is None else f"{acc_len:.2f}"
        acc_rate = "-" if acc_rate is None else f"{acc_rate:.0%}"
        print(f"{name:18s} {r['mean_tok_s']:10.1f} {r['median_tok_s']:8.1f} {acc_len:>8s} "
              f"{acc_rate:>9s} {r['outputs_equal_to_deepinfer_plain']:>10s}")
    ratio = results["deepinfer_ngram"]["mean_tok_s"] / results["vllm_ngram"]["mean_tok_s"]
    print(f"DeepInfer ngram / vLLM ngram: {ratio:.2f}x; "
          f"vLLM's chat template gives the same ids: {template_equal}")
    print(f"load average 1-min during run: mean {statistics.fmean(load.samples):.2f}, "
          f"max {max(load.samples):.2f}")

    if args.json:
        vllm_version = subprocess.run(
            [vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True, text=True).stdout.strip()
        report = {
            "benchmark": "spec_vs_vllm", "command": " ".join(sys.argv),
            "model": base.engine.model_name, "dtype": "bfloat16", "threads": args.threads,
            "speculative_config": NGRAM, "max_tokens": args.max_tokens,
            "num_prompts": args.num_prompts, "vllm_version": vllm_version,
            "vllm_model": "fp32 HF checkpoint dequantised from the same GGUF (peers/setup.sh)",
            "vllm_chat_template_ids_equal": template_equal,
            "deepinfer_ngram_over_vllm_ngram": ratio,
            "host": platform.node(), "cpu_count": os.cpu_count(),
            "load_average_before": load_before, "load_average_after": load_after,
            "load_average_1min_during": {"mean": statistics.fmean(load.samples),
                                         "max": max(load.samples)},
            "results": results,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
