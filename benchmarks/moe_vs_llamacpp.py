"""DeepInfer against llama.cpp on random MoE checkpoints of realistic shape, same weights.

    PEER_WORK=/path/to/peers .venv/bin/python benchmarks/moe_vs_llamacpp.py \
        --json benchmarks/results/moe_vs_llamacpp.json

Each shape is written by transformers (bf16, fixed seed, the default model's tokenizer) and
converted to a bf16 GGUF by llama.cpp's own converter (`../shared/peers/setup.sh` builds
llama.cpp and the converter's venv into PEER_WORK). Then, per round, the two engines run one
after the other on the same box (nothing else should run):

- pp512: llama-bench `-p 512` against DeepInfer's time to the first token of one 512-token
  prompt (512 / TTFT, so DeepInfer's figure also carries its scheduling and sampling);
- batch-1 decode: llama-bench `-n 64` (tg64) against one greedy request's decode rate;
- 16-way decode: llama-batched-bench `-npp 128 -ntg 64 -npl 16` S_TG against 16 concurrent
  128-token prompts decoding 64 tokens, DeepInfer's rate taken from the first first-token to
  the last token (any prefill that overlaps decode counts against DeepInfer).

Both use every core; EOS is ignored on both sides. JSON out (per round and best).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import time

SHAPES = {
    # ~1.35B: 64 experts top-8 (softmax, renormalised), hidden 1024, 16 layers
    "qwen3moe": dict(arch="qwen3moe", hidden=1024, layers=16, experts=64, top_k=8, moe_inter=384),
    # ~0.7B: MLA (r 512), 64 experts top-8 in 8 groups (4 kept), one shared expert,
    # first layer dense
    "deepseekv3": dict(arch="deepseekv3", hidden=1024, layers=12, experts=64, top_k=8,
                       moe_inter=256),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt")


def write_checkpoint(out_dir: str, shape: dict, tokenizer_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig

    vocab = json.load(open(os.path.join(tokenizer_dir, "config.json")))["vocab_size"]
    common = dict(vocab_size=vocab, hidden_size=shape["hidden"],
                  num_hidden_layers=shape["layers"], max_position_embeddings=4096,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  num_experts_per_tok=shape["top_k"], moe_intermediate_size=shape["moe_inter"])
    if shape["arch"] == "qwen3moe":
        config = Qwen3MoeConfig(**common, intermediate_size=3 * shape["hidden"],
                                num_experts=shape["experts"], norm_topk_prob=True,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    else:
        config = DeepseekV3Config(**common, intermediate_size=3 * shape["hidden"],
                                  num_attention_heads=16, num_key_value_heads=16,
                                  n_routed_experts=shape["experts"], n_shared_experts=1,
                                  n_group=8, topk_group=4, first_k_dense_replace=1,
                                  q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
                                  qk_rope_head_dim=64, v_head_dim=128,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # small weights so activations stay finite through every layer
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.02)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)


def convert_to_gguf(hf_dir: str, gguf_path: str, peers: str) -> None:
    converter = glob.glob(os.path.join(peers, "llamacpp/llama_cpp_python-*/vendor/llama.cpp/"
                                              "convert_hf_to_gguf.py"))[0]
    subprocess.run([os.path.join(peers, "venv-ref/bin/python"), converter, hf_dir,
                    "--outtype", "bf16", "--outfile", gguf_path], check=True,
                   stdout=subprocess.DEVNULL)


def measure_deepinfer(hf_dir: str) -> dict:
    """Runs inside a fresh process (this file with --deepinfer-model)."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=hf_dir, dtype="bfloat16", kv_cache_memory="2GiB", seed=0)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(200, vocab - 200) for _ in range(length)]}
                for _ in range(n)]

    def run(n: int, length: int, max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate(prompts(n, length), params, use_tqdm=False)

    run(2, 64, 8)  # warm-up (kernels, allocator)
    run(16, 128, 4)
    out = run(1, 512, 1)[0]
    pp512 = 512 / (out.metrics.first_token_time - out.metrics.arrival_time)
    out = run(1, 4, 65)[0]
    tg64 = 64 / (out.metrics.last_token_time - out.metrics.first_token_time)
    outs = run(16, 128, 64)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    npl16 = sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first)
    return {"pp512": pp512, "tg64": tg64, "npl16_tg": npl16}


def measure_llamacpp(gguf: str, peers: str) -> dict:
    bin_dir = os.path.join(peers, "llamacpp/bin")
    threads = str(os.cpu_count())
    bench = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", threads,
                            "-p", "512", "-n", "64", "-r", "2", "-o", "json"],
                           check=True, capture_output=True, text=True).stdout
    rows = json.loads(bench)
    result = {("pp512" if r["n_prompt"] else "tg64"): r["avg_ts"] for r in rows}
    batched = subprocess.run([os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf,
                              "-t", threads, "-c", "4096", "-b", "2048", "-ub", "512",
                              "-npp", "128", "-ntg", "64", "-npl", "16",
                              "--output-format", "jsonl"],
                             check=True, capture_output=True, text=True).stdout
    for line in batched.splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            result["npl16_tg"] = json.loads(line)["speed_tg"]
    if "npl16_tg" not in result:
        raise RuntimeError(f"no jsonl row from llama-batched-bench:\n{batched[-2000:]}")
    return result


def deepinfer_subprocess(hf_dir: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--deepinfer-model", hf_dir], check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", default=os.environ.get("PEER_WORK"),
                   help="PEER_WORK of ../shared/peers/setup.sh (llama.cpp + converter venv)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work", default=None, help="where checkpoints go (kept between runs)")
    p.add_argument("--json", default=None)
    p.add_argument("--deepinfer-model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.deepinfer_model:
        print(json.dumps(measure_deepinfer(args.deepinfer_model)))
        return
    if not args.peers:
        p.error("set PEER_WORK or --peers (../shared/peers/setup.sh builds it)")
    work = args.work or os.path.join(args.peers, "moe_ckpt")
    tokenizer_dir = os.path.join(args.peers, "models/hf")
    report = {"shapes": {}, "rounds": args.rounds, "loadavg_start": os.getloadavg()}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        hf_dir = os.path.join(work, name)
        gguf = os.path.join(work, f"{name}-bf16.gguf")
        if not os.path.exists(os.path.join(hf_dir, "config.json")):
            write_checkpoint(hf_dir, shape, tokenizer_dir)
        if not os.path.exists(gguf):
            convert_to_gguf(hf_dir, gguf, args.peers)
        runs = {"deepinfer": [], "llamacpp": []}
        for _ in range(args.rounds):  # engines alternate inside every round
            runs["deepinfer"].append(deepinfer_subprocess(hf_dir))
            runs["llamacpp"].append(measure_llamacpp(gguf, args.peers))
            print(name, json.dumps({k: v[-1] for k, v in runs.items()}), file=sys.stderr)
        best = {engine: {m: max(r[m] for r in rs) for m in rs[0]} for engine, rs in runs.items()}
        report["shapes"][name] = {
            "shape": shape, "runs": runs, "best": best,
            "ratio_best": {m: best["deepinfer"][m] / best["llamacpp"][m] for m in best["llamacpp"]}}
        print(name, "deepinfer/llama.cpp", json.dumps(report["shapes"][name]["ratio_best"]),
              file=sys.stderr)
    report.update(loadavg_end=os.getloadavg(), cpu_count=os.cpu_count(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
