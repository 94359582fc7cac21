"""Encode routing: least queued image patches, with reservations between load reports."""
from __future__ import annotations

import pytest

from deepinfer.routing import NoWorkerAvailable, WorkerLoad
from deepinfer.routing.encode_router import ENCODE_POLICIES, EncodeRequest, build_encode_router


def load(wid: str, t: float = 0.0, patches: int = 0, images: int = 0, healthy: bool = True,
         role: str = "encode") -> WorkerLoad:
    return WorkerLoad(wid, role, t, num_waiting_reqs=images, num_queued_uncached_tokens=patches,
                      healthy=healthy)


def req(rid: str, patches: int = 576, images: int = 1) -> EncodeRequest:
    return EncodeRequest(rid, num_images=images, num_patches=patches)


def test_least_queued_patches_wins():
    router = build_encode_router()
    loads = [load("encode-0", patches=2000, images=2), load("encode-1", patches=600, images=5)]
    assert router.route(req("a"), loads, now=1.0) == "encode-1"


def test_reservations_spread_a_burst_between_reports():
    router = build_encode_router()
    loads = [load(f"encode-{i}") for i in range(3)]
    picks = [router.route(req(f"r{i}", patches=100 * (i + 1)), loads, now=1.0) for i in range(3)]
    assert sorted(picks) == ["encode-0", "encode-1", "encode-2"]
    # encode-0 holds 100 reserved patches, the least: it takes the next one.
    assert router.route(req("r3"), loads, now=1.0) == "encode-0"
    assert router.reserved("encode-0").num_uncached_tokens == 100 + 576


def test_newer_report_releases_reservations():
    router = build_encode_router()
    router.route(req("a", patches=5000), [load("encode-0"), load("encode-1")], now=1.0)
    # Both report at t=2: encode-0's report includes the request (now queued there).
    loads = [load("encode-0", t=2.0, patches=300, images=1), load("encode-1", t=2.0, patches=400)]
    assert router.route(req("b"), loads, now=2.5) == "encode-0"
    assert router.reserved("encode-0").num_reqs == 1  # only "b"


def test_abort_releases_its_reservation():
    router = build_encode_router()
    loads = [load("encode-0"), load("encode-1")]
    first = router.route(req("a", patches=10_000), loads, now=1.0)
    router.on_request_aborted("a", first)
    assert router.reserved(first).num_uncached_tokens == 0


def test_only_healthy_encode_workers_are_routable():
    router = build_encode_router()
    loads = [load("encode-0", healthy=False), load("prefill-0", role="prefill"), load("encode-1", patches=9)]
    assert router.route(req("a"), loads, now=0.0) == "encode-1"
    router.remove_worker("encode-1")
    with pytest.raises(NoWorkerAvailable):
        router.route(req("b"), loads, now=0.0)


def test_round_robin_and_bad_policy():
    router = build_encode_router("round-robin")
    loads = [load("encode-0", patches=0), load("encode-1", patches=10**6)]
    assert [router.route(req(f"r{i}"), loads, 0.0) for i in range(3)] == ["encode-0", "encode-1", "encode-0"]
    with pytest.raises(ValueError, match="unknown encode routing policy"):
        build_encode_router("nearest")
    assert set(ENCODE_POLICIES) == {"least-patches", "round-robin"}


def test_encode_request_validates():
    with pytest.raises(ValueError):
        EncodeRequest("a", num_images=0, num_patches=0)
    with pytest.raises(ValueError):
        EncodeRequest("a", num_images=2, num_patches=1)
