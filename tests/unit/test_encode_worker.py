"""EncodeWorker (no sockets): cache hits answer at once, misses are batched and encoded once,
embeddings land in the LRU and the shared store, failures fail only their requests."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.wire.encode_messages import EncodeImages
from deepinfer.cluster.encode_worker import EncodeWorker
from deepinfer.kvstore.memory_store import MemoryKVBlockStore
from deepinfer.multimodal.embedding_cache import EmbeddingCache
from deepinfer.multimodal.embedding_store import StoreEmbeddingTier, embedding_store_salt
from deepinfer.wire.mm_inputs import PixelArray


class FakeTower:
    """[N, 3, H, W] -> [N, 2, 4]: each image's rows are its pixel mean, so results are checkable."""

    def __init__(self, fail_on_value: float | None = None):
        self.batches: list[int] = []
        self.fail_on_value = fail_on_value

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.fail_on_value is not None and (pixel_values == self.fail_on_value).any():
            raise RuntimeError("bad pixels")
        self.batches.append(pixel_values.shape[0])
        means = pixel_values.mean(dim=(1, 2, 3))
        return means[:, None, None].expand(-1, 2, 4).clone()


def pixels(value: float, size: int = 4) -> PixelArray:
    return PixelArray.from_numpy(np.full((3, size, size), value, dtype=np.float32))


def images(rid: str, *values: float, size: int = 4) -> EncodeImages:
    return EncodeImages(rid, [f"h{v}-{size}" for v in values], [pixels(v, size) for v in values],
                        num_patches=2 * len(values))


def make_worker(tower=None, store=None, max_batch=8):
    tier = StoreEmbeddingTier(store) if store is not None else None
    return EncodeWorker(tower or FakeTower(), EmbeddingCache(1 << 20, store=tier), max_batch_images=max_batch)


def run_until_idle(worker) -> list:
    finished = []
    for _ in range(20):
        if not worker.has_work:
            break
        finished += worker.step()
    assert not worker.has_work
    return finished


def test_misses_are_batched_then_hits_answer_at_once():
    tower = FakeTower()
    worker = make_worker(tower)
    assert worker.submit(images("a", 1.0, 2.0)) is None
    assert (worker.num_queued_images, worker.num_queued_patches) == (2, 4)
    (done,) = run_until_idle(worker)
    assert done.request_id == "a" and done.error is None and done.num_local_hits == 0
    assert tower.batches == [2]
    assert torch.allclose(worker.cache.get("h2.0-4"), torch.full((2, 4), 2.0))
    again = worker.submit(images("b", 2.0, 1.0))
    assert again is not None and again.num_local_hits == 2
    assert worker.counters.num_images_encoded == 2 and worker.counters.local_hits == 2


def test_same_image_in_two_queued_requests_is_encoded_once():
    tower = FakeTower()
    worker = make_worker(tower)
    worker.submit(images("a", 5.0))
    worker.submit(images("b", 5.0, 6.0))
    finished = run_until_idle(worker)
    assert sorted(d.request_id for d in finished) == ["a", "b"]
    assert sum(tower.batches) == 2


def test_batches_hold_one_shape_and_at_most_max_images():
    tower = FakeTower()
    worker = make_worker(tower, max_batch=2)
    worker.submit(images("a", 1.0, 2.0, 3.0))
    worker.submit(images("b", 4.0, size=8))
    run_until_idle(worker)
    assert tower.batches == [2, 1, 1]


def test_store_tier_shares_embeddings_between_workers():
    store = MemoryKVBlockStore(embedding_store_salt("w"))
    first = make_worker(store=store)
    first.submit(images("a", 3.0))
    run_until_idle(first)
    second_tower = FakeTower()
    second = make_worker(second_tower, store=store)
    done = second.submit(images("b", 3.0))
    assert done is not None and done.num_store_hits == 1 and second_tower.batches == []
    assert second.counters.store_hits == 1


def test_encoder_failure_fails_only_its_requests():
    worker = make_worker(FakeTower(fail_on_value=9.0), max_batch=1)
    worker.submit(images("bad", 9.0))
    worker.submit(images("good", 1.0))
    finished = {d.request_id: d for d in run_until_idle(worker)}
    assert "bad pixels" in finished["bad"].error
    assert finished["good"].error is None


def test_abort_and_malformed_requests():
    worker = make_worker()
    worker.submit(images("a", 1.0))
    worker.abort(["a"])
    assert not worker.has_work
    bad = worker.submit(EncodeImages("x", ["h1", "h2"], [pixels(1.0)]))
    assert bad is not None and "2 image hashes and 1 pixel arrays" in bad.error


def test_vision_only_keeps_the_tower_and_drops_the_language_model():
    import torch.nn as nn

    from deepinfer.cluster.encode_worker import VisionOnly

    class Llava(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_config = "cfg"
            self.vision_tower = nn.Linear(2, 3)
            self.multi_modal_projector = nn.Linear(3, 4)
            self.lm_head = nn.Linear(4, 1000)

        def encode_images(self, pixel_values):
            assert self.vision_config == "cfg"
            return self.multi_modal_projector(self.vision_tower(pixel_values))

    model = Llava()
    x = torch.randn(5, 2)
    expected = model.encode_images(x)
    vision = VisionOnly.of(model)
    assert not hasattr(vision, "lm_head") and torch.equal(vision.encode_images(x), expected)
    plain = FakeTower()
    assert VisionOnly.of(plain) is plain
