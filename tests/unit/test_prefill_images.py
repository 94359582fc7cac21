"""A prefill worker's image steps (E/P/D): embeddings are fetched from the shared store into
the engine's cache before admission, a prompt whose embeddings are nowhere is refused with a
clear message, and image placeholders go into the stored blocks' hashes."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from deepinfer.wire.worker_messages import PrefillRequest
from deepinfer.cluster.prefill_images import image_spans, missing_embeddings
from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.kvstore.memory_store import MemoryKVBlockStore
from deepinfer.multimodal.embedding_cache import EmbeddingCache
from deepinfer.multimodal.embedding_store import StoreEmbeddingTier, embedding_store_salt
from deepinfer.wire.mm_inputs import ImagePlaceholder, MultiModalInputs, PixelArray
from deepinfer.sampling_params import SamplingParams


def request(mm_inputs) -> PrefillRequest:
    return PrefillRequest("r", [7] * 40, SamplingParams(max_tokens=1), 0.0, mm_inputs=mm_inputs)


def test_embeddings_come_from_the_store_or_the_request_is_refused():
    store = MemoryKVBlockStore(embedding_store_salt("w"))
    StoreEmbeddingTier(store).put("img-a", torch.ones(4, 8))  # an encode worker published it
    engine = SimpleNamespace(embedding_cache=EmbeddingCache(1 << 20, store=StoreEmbeddingTier(store)))
    placeholders = [ImagePlaceholder("img-a", 2, 4)]
    assert missing_embeddings(engine, request(MultiModalInputs(placeholders))) is None
    assert "img-a" in engine.embedding_cache  # fetched into the local tier before add_request
    missing = missing_embeddings(engine, request(MultiModalInputs([ImagePlaceholder("img-b", 2, 4)])))
    assert "1 image(s) were not found" in missing
    pixels = [PixelArray.from_numpy(np.zeros((3, 2, 2), np.float32))]
    assert missing_embeddings(engine, request(MultiModalInputs([ImagePlaceholder("img-b", 2, 4)], pixels))) is None
    assert missing_embeddings(engine, request(None)) is None
    assert "takes no images" in missing_embeddings(SimpleNamespace(), request(MultiModalInputs(placeholders)))


def test_placeholders_change_the_stored_block_hashes():
    a = request(MultiModalInputs([ImagePlaceholder("img-a", 2, 20)]))
    b = request(MultiModalInputs([ImagePlaceholder("img-b", 2, 20)]))
    plain = hash_request_blocks(a.prompt_token_ids, 16)
    ha = hash_request_blocks(a.prompt_token_ids, 16, images=image_spans(a))
    hb = hash_request_blocks(b.prompt_token_ids, 16, images=image_spans(b))
    assert ha[0] != hb[0] and ha[0] != plain[0] and image_spans(request(None)) == ()
