"""E/P/D: one encode, one prefill and one decode worker process (tiny CLIP LLaVA) give the same
greedy tokens as colocated serving; the same image sent again is an encode-cache hit and its
image tokens are cached prompt tokens; a different image of the same size shares no block;
an image the encode worker cannot encode fails only its request (a ValueError: 400)."""
from __future__ import annotations

import asyncio

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.multimodal.mm_inputs import MultiModalInputs, PixelArray
from tests.integration.disagg_harness import ClusterHarness
from tests.integration.llava_checkpoints import synthetic_image

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK_SIZE = 16


def chat(*images, text="Describe."):
    parts = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def epd(llava_checkpoints, tmp_path_factory):
    directory = llava_checkpoints["clip"]
    engine = EngineConfig(model=directory, dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE,
                          num_threads=1, seed=0)
    store = tmp_path_factory.mktemp("epd-store")
    cluster = ClusterConfig(num_prefill_workers=1, num_decode_workers=1, num_encode_workers=1,
                            kv_store_url=f"fs://{store}", stall_timeout_s=60.0)
    harness = ClusterHarness(cluster, engine)
    colocated = LLM(model=directory, dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE, seed=0)
    yield harness, colocated
    harness.close()


async def _generate(client, request_id, prompt_ids, mm_inputs) -> dict:
    tokens, cached = [], 0
    async for delta in client.generate(request_id, prompt_ids, GREEDY, mm_inputs=mm_inputs):
        tokens += delta.choices[0].token_ids
        cached = max(cached, delta.num_cached_tokens)
    return {"tokens": tokens, "cached": cached}


def run_chat(harness, processor, request_id, conversation) -> dict:
    prompt_ids, mm_inputs = processor.process_chat(conversation)
    result = harness.run(_generate(harness.client, request_id, prompt_ids, mm_inputs), timeout=120)
    return {**result, "prompt_ids": prompt_ids, "image": mm_inputs.placeholders[0]}


def test_epd_matches_colocated_and_reuses_cached_images(epd):
    harness, colocated = epd
    processor = colocated._processor()
    a, b, c = synthetic_image(20), synthetic_image(21), synthetic_image(22, (50, 30))
    conversations = {"one": chat(a), "two": chat(b, c, text="Compare.")}
    expected = colocated.chat(list(conversations.values()), GREEDY, use_tqdm=False)
    for (rid, conv), ref in zip(conversations.items(), expected):
        got = run_chat(harness, processor, rid, conv)
        assert got["prompt_ids"] == ref.prompt_token_ids
        assert got["tokens"] == ref.outputs[0].token_ids, rid
    worker = harness.client.encode_stage.workers["encode-0"]
    harness.wait_for(lambda: worker.counters.num_images_encoded == 3, what="encode counters")
    assert worker.counters.local_hits == 0

    again = run_chat(harness, processor, "one-again", chat(a))
    harness.wait_for(lambda: worker.counters.local_hits == 1, what="an encode-cache hit")
    assert worker.counters.num_images_encoded == 3  # not encoded again
    assert again["tokens"] == expected[0].outputs[0].token_ids
    image = again["image"]
    # Its image tokens are cached prompt tokens (every full block but the last token's).
    assert again["cached"] == (len(again["prompt_ids"]) - 1) // BLOCK_SIZE * BLOCK_SIZE > image.offset

    # A different image of the same size: equal token ids, but no block may be shared (the first
    # block already overlaps the image), and the tokens are the colocated ones for that image.
    d = synthetic_image(23)
    other = run_chat(harness, processor, "other", chat(d))
    assert other["prompt_ids"] == again["prompt_ids"] and image.offset < BLOCK_SIZE
    assert other["cached"] == 0
    ref_d, = colocated.chat([chat(d)], GREEDY, use_tqdm=False)
    assert other["tokens"] == ref_d.outputs[0].token_ids


def test_image_the_encoder_rejects_fails_only_its_request(epd):
    harness, colocated = epd
    processor = colocated._processor()
    prompt_ids, mm_inputs = processor.process_chat(chat(synthetic_image(30)))
    wrong = PixelArray.from_numpy(mm_inputs.pixel_values[0].to_numpy()[:, :8, :8].copy())
    bad = MultiModalInputs(mm_inputs.placeholders, [wrong])
    with pytest.raises(ValueError, match="image encoding failed"):
        harness.run(_generate(harness.client, "bad", prompt_ids, bad), timeout=120)
    good = harness.run(_generate(harness.client, "good", prompt_ids, mm_inputs), timeout=120)
    ref, = colocated.chat([chat(synthetic_image(30))], GREEDY, use_tqdm=False)
    assert good["tokens"] == ref.outputs[0].token_ids
    assert harness.client.is_healthy
