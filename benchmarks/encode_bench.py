"""Image-chat serving: colocated vs E1/P1/D1 (encode, prefill and decode worker processes).

Writes a random-weight LLaVA checkpoint (CLIP tower at 224 px, patch 16 -> 196 image tokens;
a small Llama decoder; the default model's tokenizer + `<image>`), starts `deepinfer serve` on it
once per mode, replays `bench serve --workload images` (synthetic PNG data URLs drawn from a pool,
so images repeat) and reports TTFT, throughput, cached prompt tokens and, for E/P/D, the encode
workers' embedding-cache hit rate (deepinfer:encode_cache_hits / deepinfer:encode_images).
Random weights: the tokens mean nothing, the costs are those of a model of this shape.

    .venv/bin/python benchmarks/encode_bench.py --num-prompts 24 --out benchmarks/results/encode_bench.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.*

from deepinfer.bench.latency_stats import summarize  # noqa: E402
from deepinfer.bench.serve_client import ClientConfig, run_benchmark  # noqa: E402
from deepinfer.bench.workloads import WorkloadConfig, build_workload  # noqa: E402
from tests.integration.llava_checkpoints import CHAT_TEMPLATE, IMAGE_TOKEN  # noqa: E402
from tests.integration.serve_process import ServeProcess  # noqa: E402

SERVER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "256MiB", "--threads", "1",
               "--max-num-seqs", "16")


def write_bench_llava(directory: str) -> str:
    """A random LLaVA of a realistic tower shape (ViT at 224/16, 6 layers x 384) over a small
    Llama (4 layers x 256)."""
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from deepinfer.runtime.model_source import resolve_model
    torch.manual_seed(0)
    tokenizer = resolve_model(None).load_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, tie_word_embeddings=False,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                              num_attention_heads=6, image_size=224, patch_size=16, projection_dim=384)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         image_seq_length=196)
    LlavaForConditionalGeneration(config).save_pretrained(directory)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 224},
                                           crop_size={"height": 224, "width": 224}),
        tokenizer=tokenizer, patch_size=16, vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN, num_additional_image_tokens=1)
    processor.save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def metric_sum(text: str, name: str, label: str | None = None) -> float:
    """Sum of a metric's samples in a /metrics page (optionally only those with `label`)."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:_total)?(\{{[^}}]*\}})?\s+(\S+)$", line)
        if match and (label is None or label in (match.group(1) or "")):
            total += float(match.group(2))
    return total


def encode_counts(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {"images": metric_sum(text, "deepinfer:encode_images"),
            "encoded": metric_sum(text, "deepinfer:encode_images_encoded"),
            "hits_local": metric_sum(text, "deepinfer:encode_cache_hits", 'tier="local"'),
            "hits_store": metric_sum(text, "deepinfer:encode_cache_hits", 'tier="store"')}


def run_mode(name: str, model_dir: str, extra: tuple[str, ...], workload, detokenize) -> dict:
    server = ServeProcess("--model", model_dir, *SERVER_ARGS, *extra)
    try:
        server.wait_ready(600)
        before = encode_counts(server.url)
        client = ClientConfig(base_url=server.url, endpoint="chat", prompt_format="text",
                              show_progress=False)
        run = asyncio.run(run_benchmark(client, workload.requests, detokenize))
        after = encode_counts(server.url)
    finally:
        server.stop()
    summary = summarize(run.results, run.duration_s)
    images = after["images"] - before["images"]
    hits = (after["hits_local"] - before["hits_local"]) + (after["hits_store"] - before["hits_store"])
    errors = [r.error for r in run.results if not r.success]
    return {"mode": name, "summary": asdict(summary), "prefix_cache_hit_rate": run.prefix_cache_hit_rate,
            "encode_images": images or None, "encode_cache_hit_rate": hits / images if images else None,
            "first_error": errors[0] if errors else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--image-sizes", default="336x336,640x480")
    p.add_argument("--num-unique-images", type=int, default=8, help="pool size (0: all distinct)")
    p.add_argument("--modes", default="colocated,epd")
    p.add_argument("--out", default="benchmarks/results/encode_bench.json")
    args = p.parse_args()
    sizes = tuple(tuple(int(v) for v in s.split("x")) for s in args.image_sizes.split(","))
    workload = build_workload(WorkloadConfig(
        kind="images", num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, request_rate=args.request_rate, image_sizes=sizes,
        num_unique_images=args.num_unique_images, seed=0))
    print(f"workload: {workload.description}", flush=True)
    with tempfile.TemporaryDirectory(prefix="encode-bench-") as tmp:
        model_dir = write_bench_llava(f"{tmp}/llava")
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        modes = {"colocated": (),
                 "epd": ("--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1",
                         "--kv-store", f"fs://{tmp}/store")}
        rows = [run_mode(m, model_dir, modes[m], workload, detokenize) for m in args.modes.split(",")]
    print(f"{'mode':<10} {'done':>5} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'req/s':>7} "
          f"{'out tok/s':>10} {'cached tok':>11} {'encode hit':>11}")
    for r in rows:
        s = r["summary"]
        cached = s["cached_token_fraction"]
        hit = r["encode_cache_hit_rate"]
        print(f"{r['mode']:<10} {s['num_completed']:>5} {s['ttft_ms']['p50']:>12.1f} "
              f"{s['ttft_ms']['p99']:>12.1f} {s['request_throughput']:>7.2f} "
              f"{s['output_throughput']:>10.1f} "
              f"{'n/a' if cached is None else f'{100 * cached:.1f}%':>11} "
              f"{'n/a' if hit is None else f'{100 * hit:.1f}%':>11}")
        if r["first_error"]:
            print(f"  first error: {r['first_error']}")
    payload = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(),
               "command": " ".join(sys.argv), "workload": workload.description,
               "server_args": list(SERVER_ARGS), "model": "random LLaVA: CLIP 224/16 x6x384 + Llama 4x256",
               "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r["summary"]["num_completed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
