"""MLA decode on CPU: the torch absorbed path (gather + SDPA over the expanded latent "head")
vs the C kernel (runtime/cpu_mla_kernel.py), per layer and end to end.

    .venv/bin/python benchmarks/mla_decode_bench.py --json benchmarks/results/mla_decode.json

Per layer (bf16, block size 16, every sequence at `--ctx` tokens of context, r=512 rope=64,
nope=128 v=128): `PagedMLAAttention._decode` with and without the kernel (absorb_query,
attention, W_UV), the attention alone (kernel call vs gather + mla_absorbed), and in the same
run the time to read the sequences' latent entries once (an int32 max over exactly those
bytes: the memory floor). The kernel does ~1088 multiply-adds per (token, head) (576 for the
score, 512 for the value sum), so at H=16 and up it is compute-bound on a CPU, not
memory-bound; the report gives its GFLOP/s too. Medians over repeats, alternating paths.

End to end: decode tok/s at batch 1 and 16 of a random DeepSeek-V3-shaped checkpoint (MLA at
DeepSeek's latent shape, 16 heads, MoE 16 experts top-4, 4 layers, hidden 1024), one engine,
the runner's kernel switched on and off between rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import BenchReport  # noqa: E402

RANK, ROPE, NOPE, V_DIM, BLOCK = 512, 64, 128, 128, 16


def _median_s(fn, min_repeats: int = 5, min_seconds: float = 0.3,
              max_seconds: float = 4.0) -> tuple[float, float]:
    """Median (wall, process CPU) seconds of `fn` after one warm-up call; fewer repeats for
    calls of seconds. CPU time is the figure to trust on a shared box at one thread (time
    spent waiting for a core does not count); wall time includes it."""
    fn()
    walls, cpus, start = [], [], time.perf_counter()
    while True:
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        elapsed = time.perf_counter() - start
        if (len(walls) >= min_repeats and elapsed >= min_seconds) or elapsed >= max_seconds:
            return statistics.median(walls), statistics.median(cpus)


def layer_case(kernel, batch: int, heads: int, ctx: int, rounds: int) -> dict:
    from deepinfer.layers.mla import MLAWeights, absorb_query, mla_absorbed
    from deepinfer.runtime.mla_attention import PagedMLAAttention
    from deepinfer.runtime.paged_attention import AttentionMetadata, DecodeMetadata

    gen = torch.Generator().manual_seed(batch * 1000 + heads)
    width = -(-ctx // BLOCK)
    num_blocks = batch * width
    entries = torch.randn(num_blocks + 1, BLOCK, RANK + ROPE, generator=gen).bfloat16()
    tables = (1 + torch.randperm(num_blocks, generator=gen)).view(batch, width)  # scattered
    lens = torch.full((batch,), ctx, dtype=torch.long)
    weights = MLAWeights((torch.randn(heads, NOPE, RANK, generator=gen) * RANK ** -0.5).bfloat16(),
                         (torch.randn(heads, V_DIM, RANK, generator=gen) * RANK ** -0.5).bfloat16(),
                         (NOPE + ROPE) ** -0.5)
    q_nope = torch.randn(batch, heads, NOPE, generator=gen).bfloat16()
    q_pe = torch.randn(batch, heads, ROPE, generator=gen).bfloat16()
    mask = (torch.arange(width * BLOCK)[None] < lens[:, None])[:, None, None, :]
    out = torch.empty(batch, heads, V_DIM, dtype=torch.bfloat16)
    backends = {
        "torch": PagedMLAAttention(None, AttentionMetadata(
            torch.zeros(0, dtype=torch.long), DecodeMetadata(batch, tables.view(-1), mask, lens), []), None),
        "kernel": PagedMLAAttention(None, AttentionMetadata(
            torch.zeros(0, dtype=torch.long), DecodeMetadata(batch, tables.view(-1), None, lens), []), kernel),
    }
    query = absorb_query(q_nope, q_pe, weights)

    def torch_attention():
        gathered = entries.index_select(0, tables.view(-1)).view(batch, -1, RANK + ROPE)
        mla_absorbed(query.unsqueeze(2), gathered, weights, mask)

    used = entries[1:].view(torch.int32)  # exactly the sequences' blocks (block 0 unused)
    names = ("torch_decode", "kernel_decode", "torch_attention", "kernel_attention", "read_floor")
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}

    def record(name, fn):
        w, c = _median_s(fn)
        wall[name].append(w)
        cpu[name].append(c)

    for _ in range(rounds):
        for path, backend in backends.items():
            record(f"{path}_decode", lambda b=backend: b._decode(q_nope, q_pe, entries, weights, out))
        record("torch_attention", torch_attention)
        record("kernel_attention", lambda: kernel(query, entries, tables, lens, RANK, weights.softmax_scale))
        record("read_floor", lambda: used.amax())
    row = {"batch": batch, "heads": heads, "ctx": ctx, "latent_bytes": batch * ctx * (RANK + ROPE) * 2}
    for kind, samples in (("wall", wall), ("cpu", cpu)):
        us = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
        row[kind] = {f"{k}_us": round(v, 1) for k, v in us.items()}
        flops = 2 * batch * ctx * heads * (RANK + ROPE + RANK)
        row[kind]["kernel_attention_gflops"] = round(flops / max(us["kernel_attention"], 1e-3) / 1e3, 1)
        row[kind]["torch_over_kernel_decode"] = round(us["torch_decode"] / us["kernel_decode"], 2)
        row[kind]["torch_over_kernel_attention"] = round(us["torch_attention"] / us["kernel_attention"], 2)
    return row


def write_checkpoint(directory: str, layers: int) -> str:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from deepinfer.runtime.model_source import resolve_model

    config = DeepseekV3Config(
        vocab_size=4096, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
        max_position_embeddings=4096, tie_word_embeddings=False, intermediate_size=2048,
        moe_intermediate_size=512, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=512, kv_lora_rank=RANK,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.05)
    model.to(torch.bfloat16).save_pretrained(directory)
    resolve_model(None).load_tokenizer().save_pretrained(directory)
    return directory


def decode_rate(llm, batch: int, prompt_len: int, num_tokens: int) -> float:
    """Decode tok/s of `batch` concurrent greedy requests (after their first tokens)."""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(100 + 7 * i + j) % 4000 + 3 for j in range(prompt_len)]}
               for i in range(batch)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    # Each request's decode rate over its own span (first to last token), summed: the batch's
    # decode throughput while the requests run together (the prefill steps of requests that
    # joined later count against the ones already decoding, as in serving).
    return sum((len(o.outputs[0].token_ids) - 1) / (o.metrics.last_token_time - o.metrics.first_token_time)
               for o in outs)


def end_to_end(args) -> dict:
    from deepinfer import LLM

    with tempfile.TemporaryDirectory(prefix="mla-bench-") as root:
        llm = LLM(model=write_checkpoint(root, args.layers), dtype="bfloat16",
                  kv_cache_memory="512MiB", seed=0)
    runner = llm.engine.runner
    kernel = runner.mla_kernel
    assert kernel is not None, "the MLA kernel is not installed (see the self-test warning)"
    paths = {"torch": None, "kernel": kernel}
    rates = {f"{p}_batch{b}": [] for p in paths for b in (1, 16)}
    for path, k in paths.items():  # warm-up
        runner.mla_kernel = k
        decode_rate(llm, 2, 8, 4)
    for _ in range(args.rounds):
        for path, k in paths.items():
            runner.mla_kernel = k
            for batch in (1, 16):
                rates[f"{path}_batch{batch}"].append(decode_rate(llm, batch, args.prompt_len, args.tokens))
    runner.mla_kernel = kernel
    median = {k: round(statistics.median(v), 2) for k, v in rates.items()}
    return {"prompt_len": args.prompt_len, "new_tokens": args.tokens, "layers": args.layers,
            "tok_s": rates, "tok_s_median": median,
            "kernel_over_torch": {f"batch{b}": round(median[f"kernel_batch{b}"] / median[f"torch_batch{b}"], 2)
                                  for b in (1, 16)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctx", type=int, default=320)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from deepinfer.runtime.cpu_mla_kernel import load_mla_kernel

    if args.threads:
        torch.set_num_threads(args.threads)
    report = BenchReport()
    kernel = load_mla_kernel()
    assert kernel is not None, "the MLA kernel did not build or failed its self-test"
    rows = []
    with torch.inference_mode():
        for heads in args.heads:
            for batch in args.batches:
                row = layer_case(kernel, batch, heads, args.ctx, args.rounds)
                rows.append(row)
                for kind in ("wall", "cpu"):
                    r = row[kind]
                    print(f"H={heads} B={batch} {kind}: decode torch {r['torch_decode_us']:.0f} us, "
                          f"kernel {r['kernel_decode_us']:.0f} us ({r['torch_over_kernel_decode']}x); "
                          f"attention torch {r['torch_attention_us']:.0f} kernel "
                          f"{r['kernel_attention_us']:.0f} us ({r['torch_over_kernel_attention']}x, "
                          f"{r['kernel_attention_gflops']} GFLOP/s); read floor {r['read_floor_us']:.0f} us",
                          file=sys.stderr, flush=True)
    result = {"kernel_isa": kernel.isa_name, "threads": torch.get_num_threads(), "per_layer": rows, "shape": {
        "rank": RANK, "rope": ROPE, "nope": NOPE, "v": V_DIM, "block_size": BLOCK, "dtype": "bfloat16"}}
    if not args.skip_engine:
        result["engine"] = end_to_end(args)
        print(f"engine: {result['engine']['tok_s_median']} ({result['engine']['kernel_over_torch']})",
              file=sys.stderr)
    report.finish(result, args.json)


if __name__ == "__main__":
    main()
