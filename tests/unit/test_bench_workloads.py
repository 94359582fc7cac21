"""Benchmark workloads: random, shared-prefix, Mooncake hash_ids → shared prefixes, Azure."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from deepinfer.bench.trace_formats import read_azure_csv, read_mooncake_jsonl
from deepinfer.bench.traces import HashBlockTokens, ShrinkConfig, spread_ticks
from deepinfer.bench.workloads import WorkloadConfig, build_workload, poisson_arrivals
from tests.shared_traces import common_prefix_len, trace_path


def test_random_workload_lengths_range_and_determinism():
    cfg = WorkloadConfig(kind="random", num_prompts=20, input_len=33, output_len=7,
                         token_id_range=(500, 600), seed=3)
    a, b = build_workload(cfg), build_workload(cfg)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert all(len(r.prompt_token_ids) == 33 and r.output_len == 7 for r in a.requests)
    assert all(500 <= t < 600 for r in a.requests for t in r.prompt_token_ids)
    assert all(r.arrival_time_s == 0.0 for r in a.requests)  # default: all at once
    other = build_workload(WorkloadConfig(kind="random", num_prompts=20, input_len=33,
                                          output_len=7, token_id_range=(500, 600), seed=4))
    assert other.requests[0].prompt_token_ids != a.requests[0].prompt_token_ids


def test_range_ratio_spreads_lengths_within_bounds():
    cfg = WorkloadConfig(kind="random", num_prompts=200, input_len=100, output_len=50,
                         range_ratio=0.5)
    lens = [len(r.prompt_token_ids) for r in build_workload(cfg).requests]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 20


def test_poisson_arrivals_rate_and_order():
    times = poisson_arrivals(4000, 20.0, np.random.default_rng(0))
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    mean_gap = times[-1] / (len(times) - 1)
    assert abs(mean_gap - 0.05) < 0.005
    assert poisson_arrivals(3, math.inf, np.random.default_rng(0)) == [0.0, 0.0, 0.0]
    cfg = WorkloadConfig(kind="random", num_prompts=50, input_len=4, output_len=4,
                         request_rate=5.0)
    arrivals = [r.arrival_time_s for r in build_workload(cfg).requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_shared_prefix_groups_share_exactly_the_system_prompt():
    cfg = WorkloadConfig(kind="shared-prefix", num_prompts=24, num_groups=3,
                         shared_prefix_len=40, input_len=10, output_len=5)
    reqs = build_workload(cfg).requests
    assert all(len(r.prompt_token_ids) == 50 for r in reqs)
    prefixes = {tuple(r.prompt_token_ids[:40]) for r in reqs}
    assert len(prefixes) == 3
    for p in prefixes:
        assert sum(tuple(r.prompt_token_ids[:40]) == p for r in reqs) == 8
    # Different groups differ early; the same group shares all 40 tokens and no more.
    same = [r for r in reqs if tuple(r.prompt_token_ids[:40]) == next(iter(prefixes))]
    assert common_prefix_len(same[0].prompt_token_ids, same[1].prompt_token_ids) < 45


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def test_mooncake_hash_ids_become_exactly_shared_prefixes(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_jsonl(path, [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 0, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 3]},
        {"timestamp": 3000, "input_length": 700, "output_length": 30, "hash_ids": [0, 4]},
        {"timestamp": 6000, "input_length": 300, "output_length": 40, "hash_ids": [5]},
    ])
    cfg = WorkloadConfig(kind=f"trace:{path}", num_prompts=10)
    reqs = build_workload(cfg).requests
    a, b, c, d = (r.prompt_token_ids for r in reqs)
    assert [len(p) for p in (a, b, c, d)] == [1100, 1500, 700, 300]
    assert [r.output_len for r in reqs] == [10, 20, 30, 40]
    assert common_prefix_len(a, b) == 1024  # blocks 0 and 1
    assert common_prefix_len(a, c) == 512
    assert common_prefix_len(a, d) < 5  # no shared block
    # Ticks are spread: the two requests at t=0 arrive 1.5 s apart within the 3 s tick.
    assert [r.arrival_time_s for r in reqs] == [0.0, 1.5, 3.0, 6.0]


def test_mooncake_shrinking_keeps_the_sharing_structure(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_jsonl(path, [
        {"timestamp": 0, "input_length": 1100, "output_length": 100, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 1500, "output_length": 300, "hash_ids": [0, 1, 3]},
    ])
    shrink = ShrinkConfig(length_scale=0.125, max_output_len=20)  # 512 → 64-token blocks
    cfg = WorkloadConfig(kind=f"trace:{path}", num_prompts=10, shrink=shrink, time_scale=0.5)
    w = build_workload(cfg)
    a, b = (r.prompt_token_ids for r in w.requests)
    assert (len(a), len(b)) == (138, 188)
    assert common_prefix_len(a, b) == 128
    assert [r.output_len for r in w.requests] == [12, 20]
    assert w.requests[1].arrival_time_s == pytest.approx(0.5)
    assert "64 tokens" in w.description and "capped at 20" in w.description
    truncated = build_workload(WorkloadConfig(
        kind=f"trace:{path}", shrink=ShrinkConfig(max_input_len=600))).requests
    assert [len(r.prompt_token_ids) for r in truncated] == [600, 600]
    assert common_prefix_len(*(r.prompt_token_ids for r in truncated)) == 600


def test_hash_blocks_are_deterministic_and_pad_short_hash_lists():
    blocks = HashBlockTokens(8, 10, 20, seed=1)
    assert np.array_equal(blocks.block(7), HashBlockTokens(8, 10, 20, seed=1).block(7))
    prompt = blocks.prompt((7,), 12, np.random.default_rng(0))
    assert len(prompt) == 12 and prompt[:8] == blocks.block(7).tolist()


def test_spread_ticks_starts_at_zero_and_spreads_runs():
    assert spread_ticks([5.0, 5.0, 5.0, 8.0]) == [0.0, 1.0, 2.0, 3.0]
    assert spread_ticks([]) == []


def test_azure_csv_times_are_relative_with_seven_digit_fractions(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n")
    rows = read_azure_csv(str(path))
    assert rows[0].timestamp_s == 0.0
    assert rows[1].timestamp_s == pytest.approx(4.314579, abs=1e-5)
    assert (rows[1].input_len, rows[1].output_len, rows[1].hash_ids) == (396, 109, None)
    w = build_workload(WorkloadConfig(kind=f"trace:{path}", shrink=ShrinkConfig(0.1)))
    assert [len(r.prompt_token_ids) for r in w.requests] == [37, 40]


def test_bad_inputs_raise_value_error(tmp_path):
    with pytest.raises(ValueError):
        WorkloadConfig(kind="nope")
    with pytest.raises(ValueError):
        WorkloadConfig(num_prompts=0)
    with pytest.raises(ValueError):
        ShrinkConfig(length_scale=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_mooncake_jsonl(str(bad))
    unknown = tmp_path / "x.txt"
    unknown.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="unknown trace layout"):
        build_workload(WorkloadConfig(kind=f"trace:{unknown}"))


def test_real_mooncake_trace_every_request_shares_the_system_block():
    mooncake = trace_path("mooncake", "conversation_trace.jsonl")
    cfg = WorkloadConfig(kind=f"trace:{mooncake}", num_prompts=40,
                         shrink=ShrinkConfig(length_scale=1 / 64))
    reqs = build_workload(cfg).requests
    first_block = reqs[0].prompt_token_ids[:8]
    assert all(r.prompt_token_ids[:8] == first_block for r in reqs)


def test_images_workload_sizes_repeats_and_data_urls():
    import base64
    import io

    from PIL import Image

    from deepinfer.bench.synthetic_images import image_data_url
    from deepinfer.bench.workloads import WorkloadConfig, build_workload

    distinct = build_workload(WorkloadConfig(kind="images", num_prompts=6, input_len=8, output_len=4,
                                             images_per_request=2, image_sizes=((32, 24), (16, 16))))
    specs = [s for r in distinct.requests for s in r.images]
    assert len(specs) == 12 and len(set(specs)) == 12
    assert {(s.width, s.height) for s in specs} <= {(32, 24), (16, 16)}
    pooled = build_workload(WorkloadConfig(kind="images", num_prompts=20, input_len=8, output_len=4,
                                           num_unique_images=3))
    assert len({r.images for r in pooled.requests}) <= 3
    url = image_data_url(specs[0])
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert image.format == "PNG" and image.size == (specs[0].width, specs[0].height)
    assert image_data_url(specs[0]) == url  # same spec, same image (a cache hit for the server)


def test_images_workload_flags():
    import argparse

    import pytest

    from deepinfer.bench.workload_args import add_workload_args, workload_config_from_args

    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    cfg = workload_config_from_args(parser.parse_args(
        ["--workload", "images", "--image-sizes", "64x48,32x32", "--images-per-request", "2",
         "--num-unique-images", "5"]))
    assert cfg.image_sizes == ((64, 48), (32, 32)) and cfg.images_per_request == 2
    assert cfg.num_unique_images == 5
    with pytest.raises(ValueError, match="--image-sizes"):
        workload_config_from_args(parser.parse_args(["--workload", "images", "--image-sizes", "64"]))


def test_chat_payload_sends_images_as_data_urls_before_the_text():
    import asyncio

    import pytest

    from deepinfer.bench.serve_client import ClientConfig, ServeClient
    from deepinfer.bench.synthetic_images import image_data_url
    from deepinfer.bench.workloads import BenchRequest, ImageSpec

    request = BenchRequest([1, 2, 3], 4, 0.0, (ImageSpec(1, 8, 6), ImageSpec(2, 4, 4)))

    async def payload(endpoint):
        client = ServeClient(ClientConfig(endpoint=endpoint, prompt_format="text", show_progress=False),
                             detokenize=lambda ids: "abc")
        try:
            if endpoint != "chat":
                return await client.send("m", request, 0.0)
            return client._payload("m", request)
        finally:
            await client.close()

    url, body = asyncio.run(payload("chat"))
    parts = body["messages"][0]["content"]
    assert url.endswith("/v1/chat/completions")
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    assert parts[0]["image_url"]["url"] == image_data_url(ImageSpec(1, 8, 6)) and parts[2]["text"] == "abc"
    with pytest.raises(ValueError, match="chat endpoint"):
        asyncio.run(payload("completions"))
