"""deepinfer:encode_* metrics: the colocated engine's counters reach /metrics under the same
names as the encode workers'; engines without a vision tower add no encode metrics."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from deepinfer.multimodal.encode_metrics import BucketCounts
from deepinfer.wire.engine_messages import EngineStatsSnapshot
from deepinfer.server.metrics import EngineStatsCollector


def scrape(snapshot: EngineStatsSnapshot) -> str:
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: snapshot, "m"))
    return generate_latest(registry).decode()


def test_colocated_engine_encode_metrics():
    text = scrape(EngineStatsSnapshot(embedding_cache_hits=3, embedding_cache_misses=2, num_images_encoded=2))
    assert 'deepinfer:encode_cache_hits_total{tier="local",worker_id="engine"} 3.0' in text
    assert 'deepinfer:encode_images_total{worker_id="engine"} 5.0' in text
    assert 'deepinfer:encode_images_encoded_total{worker_id="engine"} 2.0' in text
    assert "deepinfer:encode_" not in scrape(EngineStatsSnapshot())


def test_engine_stats_carry_the_embedding_counters():
    from deepinfer.multimodal.embedding_cache import EmbeddingCache, embedding_stats

    class Engine:
        embedding_cache = EmbeddingCache(100)

        class mm_images:
            num_images_encoded = 4

    Engine.embedding_cache.get("x")
    assert embedding_stats(Engine()) == {"embedding_cache_hits": 0, "embedding_cache_misses": 1,
                                         "num_images_encoded": 4}
    assert embedding_stats(object()) == {}


def test_bucket_counts_are_a_cumulative_histogram():
    hist = BucketCounts((0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        hist.observe(v)
    assert hist.cumulative() == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]
    assert hist.count == 4 and abs(hist.sum - 4.05) < 1e-9


def test_encode_stage_collector():
    from types import SimpleNamespace

    from deepinfer.wire.encode_messages import EncodeCounters
    from deepinfer.multimodal.encode_metrics import (ENCODE_TIME_BUCKETS, IMAGES_PER_REQUEST_BUCKETS,
                                                  EncodeCollector)
    from deepinfer.routing.encode_router import build_encode_router

    worker = SimpleNamespace(worker_id="encode-0", alive=True, num_queued_images=2, num_queued_patches=1152,
                             counters=EncodeCounters(num_images=5, num_images_encoded=3, local_hits=1,
                                                     store_hits=1, misses=3, encode_seconds_total=0.6))
    from collections import Counter
    stage = SimpleNamespace(workers={"encode-0": worker}, router=build_encode_router(), num_lost=0,
                            supervisor=SimpleNamespace(num_restarts=Counter(encode=2)),
                            encode_time=BucketCounts(ENCODE_TIME_BUCKETS),
                            images_per_request=BucketCounts(IMAGES_PER_REQUEST_BUCKETS))
    stage.encode_time.observe(0.2)
    stage.images_per_request.observe(2)
    registry = CollectorRegistry()
    registry.register(EncodeCollector(stage))
    text = generate_latest(registry).decode()
    assert 'deepinfer:encode_queue_patches{worker_id="encode-0"} 1152.0' in text
    assert 'deepinfer:encode_cache_hits_total{tier="store",worker_id="encode-0"} 1.0' in text
    assert 'deepinfer:encode_time_per_image_seconds_bucket{le="0.25"} 1.0' in text
    assert 'deepinfer:encode_images_per_request_count 1.0' in text
    assert 'deepinfer:encode_worker_restarts_total 2.0' in text
