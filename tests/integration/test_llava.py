"""LLaVA offline: greedy tokens equal transformers fp32 (CLIP and SigLIP towers, feature layer
-1/-2/list, select strategy default/full, one and two images of different sizes), and image
prefix caching (same image -> cached prompt tokens and an embedding-cache hit; a different image
of the same size with equal token ids shares no block)."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from tests.integration.llava_checkpoints import LLAVA_KINDS, hf_greedy, hf_llava, synthetic_image

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_pairs(llava_checkpoints):
    """{kind: (our LLM, HF model)} — one of each per checkpoint for this module."""
    pairs = {}
    for kind, directory in llava_checkpoints.items():
        llm = LLM(model=directory, dtype="float32", num_kv_blocks=64, block_size=16, seed=0)
        pairs[kind] = (llm, hf_llava(directory)[0])
    return pairs


def _chat(*images, text="Describe."):
    parts = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.mark.parametrize("kind", list(LLAVA_KINDS))
def test_chat_with_one_and_two_images_matches_transformers(llava_pairs, kind):
    llm, hf = llava_pairs[kind]
    conversations = [_chat(synthetic_image(1, (40, 36))),
                     _chat(synthetic_image(2, (20, 30)), synthetic_image(3, (64, 48)), text="Compare.")]
    outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
    processor = llm._processor()
    for conv, out in zip(conversations, outputs):
        token_ids, mm_inputs = processor.process_chat(conv)
        assert out.prompt_token_ids == token_ids
        assert len(mm_inputs.placeholders) == sum(p["type"] == "image" for p in conv[0]["content"])
        pixels = np.stack([p.to_numpy() for p in mm_inputs.pixel_values])
        expected = hf_greedy(hf, token_ids, pixels, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected


def test_generate_with_multi_modal_data_matches_transformers(llava_pairs):
    llm, hf = llava_pairs["siglip"]
    image = synthetic_image(4, (33, 47))
    prompt = "<|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\n"
    out, = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    token_ids, mm_inputs = llm._processor().process_prompt(prompt, [image])
    assert out.prompt_token_ids == token_ids
    assert out.outputs[0].token_ids == hf_greedy(hf, token_ids, mm_inputs.pixel_values[0].to_numpy()[None],
                                                 MAX_TOKENS)


def test_same_image_is_a_prefix_hit_a_different_image_shares_no_block(llava_pairs):
    llm, _ = llava_pairs["clip"]
    engine = llm.engine
    a, b = synthetic_image(10), synthetic_image(11)  # same size: equal prompt token ids
    first, = llm.chat(_chat(a), GREEDY, use_tqdm=False)
    hits, encoded = engine.embedding_cache.hits, engine.mm_images.num_images_encoded
    again, = llm.chat(_chat(a), GREEDY, use_tqdm=False)
    other, = llm.chat(_chat(b), GREEDY, use_tqdm=False)
    assert first.prompt_token_ids == again.prompt_token_ids == other.prompt_token_ids
    image = llm._processor().process_chat(_chat(a))[1].placeholders[0]
    num_prompt = len(first.prompt_token_ids)
    # Same image: every full block of the prompt (image tokens included) is cached.
    assert again.num_cached_tokens == (num_prompt - 1) // 16 * 16 >= image.end - 16
    assert again.num_cached_tokens > image.offset
    assert engine.embedding_cache.hits == hits + 1  # taken from the cache at add_request
    # A different image: the first block already overlaps the image, so nothing is shared.
    assert image.offset < 16 and other.num_cached_tokens == 0
    assert engine.mm_images.num_images_encoded == encoded + 1  # only the new image was encoded
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_image_inputs_are_refused_before_queueing(llava_pairs):
    llm, _ = llava_pairs["clip"]
    with pytest.raises(ValueError, match="image markers"):
        llm.generate({"prompt": "no marker", "multi_modal_data": {"image": synthetic_image(1)}}, GREEDY)
    with pytest.raises(ValueError, match="image tokens but no images"):
        llm.generate({"prompt_token_ids": [5, llm.engine.mm_images.image_token_id, 6]}, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_images_split_across_prefill_chunks_match_transformers(llava_pairs):
    """A 7-token budget cuts every image into several chunks (and batches two prompts)."""
    llm, hf = llava_pairs["clip_full_multi"]
    chunked = LLM(model=llm.engine.config.model, dtype="float32", share_weights_with=llm,
                  num_kv_blocks=64, block_size=16, max_num_batched_tokens=7, seed=0)
    conversations = [_chat(synthetic_image(5), synthetic_image(6), text="Two."), _chat(synthetic_image(7))]
    outputs = chunked.chat(conversations, GREEDY, use_tqdm=False)
    assert chunked.engine.mm_images.num_encode_batches >= 2  # encoded when first covered, not upfront
    for conv, out in zip(conversations, outputs):
        token_ids, mm = chunked._processor().process_chat(conv)
        pixels = np.stack([p.to_numpy() for p in mm.pixel_values])
        assert out.outputs[0].token_ids == hf_greedy(hf, token_ids, pixels, MAX_TOKENS)


def _decode_side_recompute(llm, chat, store_url=None):
    """P/D in process: `llm`'s engine prefills `chat`, its prompt KV goes to a decode worker's
    engine (no prefix caching: a recompute covers the image) and loop (no sockets), and the
    request is preempted after two tokens and recomputed there.
    Returns (token ids, the errors the decode worker reports)."""
    import time

    from deepinfer.cluster.decode_engine import DisaggDecodeEngine
    from deepinfer.cluster.decode_worker import DecodeWorkerLoop
    from deepinfer.cluster.worker_spec import WorkerSpec
    from deepinfer.engine.engine_config import EngineConfig

    prefill = llm.engine
    prompt, mm = llm._processor().process_chat(chat)
    prefill.add_request("h", prompt, GREEDY, mm_inputs=mm)
    first = []
    while not first:
        for out in prefill.step():
            first = list(out.outputs[0].token_ids)
    kv = prefill.cache.read_blocks(prefill.scheduler.kv.block_ids("h"))
    prefill.abort_request(["h"])
    decode = DisaggDecodeEngine(EngineConfig(model=None, dtype="float32", num_kv_blocks=16, block_size=16,
                                             enable_prefix_caching=False),
                                source=prefill.source, model=prefill.model, tokenizer=prefill.tokenizer)
    loop = DecodeWorkerLoop(WorkerSpec("decode-0", "decode", decode.config, "", "", kv_store_url=store_url),
                            decode, None, None, transport=None)
    block_ids = decode.add_transferred_request("h", prompt, GREEDY, time.monotonic(), first[0], None,
                                               mm_inputs=mm.without_pixels())  # as DecodeRequest carries it
    decode.cache.write_blocks(block_ids, kv)
    decode.admit_transferred("h")
    loop.tracker.resume("h", num_tokens=1, num_text_chars=0)
    tokens = first
    for n in range(3 * MAX_TOKENS):
        if n == 2:  # debug hook: preempted as if the decode worker ran out of blocks
            decode.scheduler._preempt(decode.scheduler.requests["h"])
        outputs = decode.step()
        loop.after_step(outputs)
        for out in outputs:
            tokens = out.outputs[0].token_ids
        if not decode.has_unfinished_requests():
            break
    return list(tokens), loop._errors


@pytest.mark.slow
def test_decode_worker_recompute_takes_image_embeddings_from_the_store(llava_pairs, tmp_path):
    """A decode worker that recomputes a preempted image request splices the image's embeddings
    (fetched from the shared store, as an encode/prefill worker left them): the tokens are the
    colocated engine's."""
    from deepinfer.multimodal.embedding_store import open_embedding_tier
    llm, _ = llava_pairs["clip"]
    chat = _chat(synthetic_image(30))
    expected = llm.chat(chat, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    image = llm._processor().process_chat(chat)[1].placeholders[0]
    store_url = f"fs://{tmp_path / 'store'}"
    open_embedding_tier(store_url, llm.engine.source).put(image.image_hash,
                                                          llm.engine.embedding_cache.get(image.image_hash))
    tokens, errors = _decode_side_recompute(llm, chat, store_url)
    assert not errors and tokens == expected


@pytest.mark.slow
def test_decode_worker_recompute_without_embeddings_fails_clearly(llava_pairs):
    llm, _ = llava_pairs["clip"]
    tokens, errors = _decode_side_recompute(llm, _chat(synthetic_image(31)))
    assert [e.request_id for e in errors] == ["h"]
    assert "preempted on its decode worker" in errors[0].message and "embeddings" in errors[0].message
    assert len(tokens) < MAX_TOKENS  # nothing computed without the image after the preemption
