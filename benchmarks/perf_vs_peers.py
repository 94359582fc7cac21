"""Side by side: DeepInfer vs llama.cpp (and optionally vLLM CPU) in one run.

Same machine, same model (SmolLM2-135M-Instruct: DeepInfer's embedded GGUF; llama.cpp the bf16
GGUF and vLLM the HF checkpoint that ../shared/peers/setup.sh dequantises from that same file),
bf16, the same thread count, engines alternating round by round:

* W1: 64 random-token prompts x 256 in / 128 out, greedy, EOS ignored -> output tok/s.
  DeepInfer / vLLM: one offline `LLM.generate` of all 64. llama.cpp: `llama-server` with 64
  slots and 64 concurrent /completion requests (wall from the first send to the last reply).
* batch-1 decode tok/s: one request, 16-token prompt, 128 output tokens; decode time is the
  128-token call minus a 1-token call on a prompt of the same length. llama.cpp: llama-bench tg128.
* 512-token TTFT: one request, 512-token prompt, 1 output token. llama.cpp: 512 / llama-bench pp512.

Plus the machine: bf16 matmul peak (torch, big square) and memory bandwidth (a large sum and a
large copy), and the bounds they imply for this model (see `bounds()`).

Each engine's measurement runs in a child process of its own Python (this file with --child),
so no engine shares a process or a warm cache with another. The full run (2 rounds; estimated
~5 min on a quiet 2-core box, ~2 min more per round with --vllm):

    PEER_WORK=/tmp/peers .venv/bin/python benchmarks/perf_vs_peers.py --threads 2 \\
        --json benchmarks/results/perf_vs_peers.json

`--quick` shrinks every workload (for checking the script, not for numbers); `--vllm` adds vLLM
CPU (slow to start); `--skip-llamacpp` measures without the peers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GGUF_NAME = "SmolLM2-135M-Instruct-bf16.gguf"
sys.path.insert(0, HERE)
from server_health import wait_healthy  # noqa: E402


# --- one engine, measured inside its own process (--child) ------------------------------------

def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, vocab - 200) for _ in range(length)] for _ in range(num)]


def child_measure(engine: str, w: dict, threads: int) -> dict:
    """W1, batch-1 decode and TTFT through a vLLM-shaped `LLM` (DeepInfer's or vLLM's)."""
    t0 = time.perf_counter()
    if engine == "deepinfer":
        from deepinfer import LLM, SamplingParams
        llm = LLM(model=None, dtype="bfloat16", num_threads=threads, seed=0)

        def wrap(ids):
            return {"prompt_token_ids": ids}
    else:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=w["vllm_model"], dtype="bfloat16", max_model_len=1024, seed=0)

        def wrap(ids):
            return TokensPrompt(prompt_token_ids=ids)
    init_s = time.perf_counter() - t0
    vocab = llm.get_tokenizer().vocab_size

    def gen(prompts, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([wrap(p) for p in prompts], sp, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return elapsed

    n, lin, lout = w["num_prompts"], w["input_len"], w["output_len"]
    gen(_prompts(min(n, 8), lin, vocab, 7), 8)  # warm-up: prefill and decode shapes
    gen(_prompts(1, w["ttft_len"], vocab, 8), 2)
    w1 = [n * lout / gen(_prompts(n, lin, vocab, 100 + r), lout) for r in range(w["w1_reps"])]
    ttft, decode = [], []
    for r in range(w["reps"]):
        ttft.append(gen(_prompts(1, w["ttft_len"], vocab, 200 + r), 1))
        first = gen(_prompts(1, 16, vocab, 300 + r), 1)
        full = gen(_prompts(1, 16, vocab, 400 + r), w["decode_tokens"] + 1)
        decode.append(w["decode_tokens"] / max(full - first, 1e-9))
    return {"engine": engine, "init_s": init_s, "w1_output_tok_s": max(w1), "w1_all": w1,
            "batch1_decode_tok_s": max(decode), "batch1_all": decode,
            "ttft_512_s": min(ttft), "ttft_all": ttft}


def run_child(python: str, engine: str, w: dict, threads: int, env: dict, timeout: float) -> dict:
    cmd = [python, os.path.abspath(__file__), "--child", engine, "--threads", str(threads),
           "--workload", json.dumps(w)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=env.get("CHILD_CWD", ROOT), stdin=subprocess.DEVNULL)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT_JSON "):
            return json.loads(line[len("RESULT_JSON "):])
    raise RuntimeError(f"{engine} child failed (rc {proc.returncode}): {proc.stderr[-1500:]}")


# --- llama.cpp ---------------------------------------------------------------------------------

def _post(url: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llamacpp_server_w1(bin_dir: str, gguf: str, w: dict, threads: int, port: int,
                       seed: int) -> dict:
    """W1 against llama-server: 64 slots, all requests sent at once (a barrier), no prompt cache."""
    n = w["num_prompts"]
    ctx = n * (w["input_len"] + w["output_len"] + 8)
    cmd = [os.path.join(bin_dir, "llama-server"), "-m", gguf, "--host", "127.0.0.1",
           "--port", str(port), "-np", str(n), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-t", str(threads), "-tb", str(threads), "--cache-ram", "0", "--no-webui"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, 120, name="llama-server")
        url = f"http://127.0.0.1:{port}/completion"
        _post(url, {"prompt": "Hello", "n_predict": 8, "ignore_eos": True, "temperature": 0})
        prompts = _prompts(n, w["input_len"], w["vocab"], 500 + seed)
        barrier = threading.Barrier(n)

        def one(p):
            body = {"prompt": p, "n_predict": w["output_len"], "ignore_eos": True,
                    "temperature": 0.0, "top_k": 1, "cache_prompt": False, "stream": False}
            barrier.wait()
            start = time.perf_counter()
            reply = _post(url, body)
            return start, time.perf_counter(), reply["tokens_predicted"]

        with ThreadPoolExecutor(max_workers=n) as pool:
            res = list(pool.map(one, prompts))
        wall = max(r[1] for r in res) - min(r[0] for r in res)
        num_out = sum(r[2] for r in res)
        assert num_out == n * w["output_len"], num_out
        return {"w1_output_tok_s": num_out / wall, "w1_wall_s": wall}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def llama_bench(bin_dir: str, gguf: str, w: dict, threads: int) -> dict:
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads),
           "-p", str(w["ttft_len"]), "-n", str(w["decode_tokens"]), "-r", str(w["reps"]),
           "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {proc.stderr[-800:]}")
    rows = json.loads(proc.stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"])
    tg = next(r["avg_ts"] for r in rows if r["n_gen"])
    return {"pp_tok_s": pp, "batch1_decode_tok_s": tg, "ttft_512_s": w["ttft_len"] / pp}


# --- the machine and the bounds it implies ---------------------------------------------------

def machine_peaks(threads: int, size: int = 2048, copy_mib: int = 512) -> dict:
    import torch
    torch.set_num_threads(threads)
    a = torch.randn(size, size, dtype=torch.bfloat16)
    b = torch.randn(size, size, dtype=torch.bfloat16)
    torch.matmul(a, b)
    best = min(_timed(lambda: torch.matmul(a, b)) for _ in range(5))
    flops = 2 * size ** 3 / best
    x = torch.ones(copy_mib * 2 ** 20 // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    x.sum(), y.copy_(x)
    read = min(_timed(lambda: x.sum()) for _ in range(5))
    copy = min(_timed(lambda: y.copy_(x)) for _ in range(5))
    nbytes = x.numel() * 4
    # The same read on 2 MiB pages (the engine keeps its weights there): on 4 KiB pages the
    # TLB, not DRAM, limits a streaming read on this kind of guest, which would understate
    # the bound. The bound takes the faster of the two.
    from deepinfer.runtime.cpu_huge_pages import huge_page_arena
    xh = huge_page_arena(nbytes).view(torch.float32)
    xh.fill_(1.0)
    read_huge = min(_timed(lambda: xh.sum()) for _ in range(5))
    return {"bf16_matmul_gflop_s": flops / 1e9, "matmul_size": size,
            "read_4k_pages_gb_s": nbytes / read / 1e9, "read_huge_pages_gb_s": nbytes / read_huge / 1e9,
            "read_gb_s": nbytes / min(read, read_huge) / 1e9, "copy_gb_s": 2 * nbytes / copy / 1e9,
            "threads": threads}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_shape() -> dict:
    """Parameter counts of the default model, from its config (no weights loaded)."""
    from deepinfer.runtime.model_source import resolve_model
    c = resolve_model(None).config
    h, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * c.head_dim
    per_layer = h * (c.num_attention_heads * c.head_dim) * 2 + h * kv * 2 + 3 * h * inter
    return {"layer_params": layers * per_layer, "lm_head_params": c.vocab_size * h,
            "num_layers": layers, "vocab": c.vocab_size}


def bounds(m: dict, peaks: dict, w: dict) -> dict:
    """Upper limits from the measured peaks (linears only; attention FLOPs and activations
    are left out, so real limits are a little lower):

    * W1 output tok/s <= peak / (2 * (layer_params * (in + out) + lm_head * out) / out)
    * batch-1 tok/s   <= read bandwidth / bf16 bytes of the weights read per token
    * 512 TTFT        >= 2 * (layer_params * 512 + lm_head) / peak"""
    peak = peaks["bf16_matmul_gflop_s"] * 1e9
    lin, lout = w["input_len"], w["output_len"]
    flops_per_out = 2 * (m["layer_params"] * (lin + lout) + m["lm_head_params"] * lout) / lout
    weight_bytes = 2 * (m["layer_params"] + m["lm_head_params"])
    ttft_flops = 2 * (m["layer_params"] * w["ttft_len"] + m["lm_head_params"])
    return {"w1_output_tok_s": peak / flops_per_out,
            "batch1_decode_tok_s": peaks["read_gb_s"] * 1e9 / weight_bytes,
            "ttft_512_s": ttft_flops / peak, "weight_bytes": weight_bytes}


# --- the run -----------------------------------------------------------------------------------

def workload(quick: bool) -> dict:
    if quick:
        return {"num_prompts": 8, "input_len": 64, "output_len": 16, "decode_tokens": 16,
                "ttft_len": 128, "reps": 1, "w1_reps": 1}
    return {"num_prompts": 64, "input_len": 256, "output_len": 128, "decode_tokens": 128,
            "ttft_len": 512, "reps": 3, "w1_reps": 1}


def table(engines: dict, bound: dict, ttft_len: int = 512) -> str:
    ref = engines.get("llama.cpp")
    head = (f"| engine | W1 output tok/s | batch-1 decode tok/s | {ttft_len}-token TTFT |"
            " W1 vs llama.cpp | batch-1 vs llama.cpp | TTFT speed-up vs llama.cpp |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    rows = dict(engines)
    rows["bound (measured peaks)"] = bound
    for name, r in rows.items():
        cells = [f"{r['w1_output_tok_s']:.1f}" if r.get("w1_output_tok_s") else "-",
                 f"{r['batch1_decode_tok_s']:.1f}" if r.get("batch1_decode_tok_s") else "-",
                 f"{r['ttft_512_s']:.3f} s" if r.get("ttft_512_s") else "-"]
        for key, inverse in (("w1_output_tok_s", False), ("batch1_decode_tok_s", False),
                             ("ttft_512_s", True)):
            if ref and r.get(key) and ref.get(key):
                ratio = ref[key] / r[key] if inverse else r[key] / ref[key]
                cells.append(f"{ratio:.2f}x")
            else:
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarise(per_round: list[dict]) -> dict:
    """Best of the rounds per engine and metric (the box is shared: slow rounds are noise)."""
    best: dict[str, dict] = {}
    for rnd in per_round:
        for name, r in rnd.items():
            b = best.setdefault(name, {})
            for key in ("w1_output_tok_s", "batch1_decode_tok_s"):
                if r.get(key):
                    b[key] = max(b.get(key, 0.0), r[key])
            if r.get("ttft_512_s"):
                b["ttft_512_s"] = min(b.get("ttft_512_s", float("inf")), r["ttft_512_s"])
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=("deepinfer", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (best is reported)")
    ap.add_argument("--peer-work", default=os.environ.get("PEER_WORK", "/tmp/peers"))
    ap.add_argument("--vllm", action="store_true", help="also vLLM CPU (its venv in PEER_WORK)")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny workloads: checks the script only")
    ap.add_argument("--port", type=int, default=18190)
    ap.add_argument("--json", dest="json_path",
                    default=os.path.join(HERE, "results", "perf_vs_peers.json"))
    args = ap.parse_args()
    if args.child:
        print("RESULT_JSON " + json.dumps(child_measure(args.child, json.loads(args.workload),
                                                        args.threads)), flush=True)
        return 0
    if args.threads < 1 or args.rounds < 1:
        ap.error("--threads and --rounds must be positive")
    w = workload(args.quick)
    pw = args.peer_work
    bin_dir = os.path.join(pw, "llamacpp", "bin")
    gguf = os.path.join(pw, "models", "gguf", GGUF_NAME)
    if not args.skip_llamacpp and not (os.path.exists(os.path.join(bin_dir, "llama-server"))
                                       and os.path.exists(gguf)):
        ap.error(f"llama.cpp peers not found in {pw} (llamacpp/bin, models/gguf/{GGUF_NAME}); "
                 "build them with shared/peers/setup.sh or pass --skip-llamacpp")
    vllm_python = os.path.join(pw, "vllm", "bin", "python")
    if args.vllm:
        if not os.path.exists(vllm_python):
            ap.error(f"--vllm: {vllm_python} not found")
        w["vllm_model"] = os.path.join(pw, "models", "hf")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    vllm_env = dict(env, VLLM_CPU_KVCACHE_SPACE="4", CHILD_CWD=pw,
                    VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    shape = model_shape()
    w["vocab"] = shape["vocab"]
    started = time.time()
    load_before = _loadavg()
    peaks = machine_peaks(args.threads)
    print(f"machine: bf16 matmul {peaks['bf16_matmul_gflop_s']:.0f} GFLOP/s, read "
          f"{peaks['read_gb_s']:.1f} GB/s (4 KiB pages {peaks['read_4k_pages_gb_s']:.1f}, huge pages "
          f"{peaks['read_huge_pages_gb_s']:.1f}), copy {peaks['copy_gb_s']:.1f} GB/s", flush=True)
    per_round = []
    for rnd in range(args.rounds):
        got = {"DeepInfer": run_child(sys.executable, "deepinfer", w, args.threads, env, 900)}
        print(f"round {rnd}: DeepInfer {_brief(got['DeepInfer'])}", flush=True)
        if not args.skip_llamacpp:
            lc = llamacpp_server_w1(bin_dir, gguf, w, args.threads, args.port, rnd)
            lc.update(llama_bench(bin_dir, gguf, w, args.threads))
            got["llama.cpp"] = lc
            print(f"round {rnd}: llama.cpp {_brief(lc)}", flush=True)
        if args.vllm:
            got["vLLM CPU"] = run_child(vllm_python, "vllm", w, args.threads, vllm_env, 1200)
            print(f"round {rnd}: vLLM CPU {_brief(got['vLLM CPU'])}", flush=True)
        per_round.append(got)
    best = summarise(per_round)
    bound = bounds(shape, peaks, w)
    print(table(best, bound, w["ttft_len"]))
    report = {"workload": w, "threads": args.threads, "rounds": per_round, "best": best,
              "machine": dict(peaks, cpu_count=os.cpu_count(), platform=platform.platform(),
                              load_before=load_before, load_after=_loadavg()),
              "bounds": bound, "quick": args.quick, "elapsed_s": time.time() - started,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
    with open(args.json_path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.json_path} ({report['elapsed_s']:.0f} s)")
    return 0


def _brief(r: dict) -> str:
    return (f"W1 {r.get('w1_output_tok_s', 0):.1f} out tok/s, batch-1 "
            f"{r.get('batch1_decode_tok_s', 0):.1f} tok/s, TTFT {r.get('ttft_512_s', 0):.3f} s")


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
