"""Store-aware least-compute routing (pure): prefixes in flight are reused, not recomputed;
stored prefixes spread over workers; loading vs recomputing is decided by cost."""
from __future__ import annotations

import pytest

from deepinfer.core.cost_model import RateEstimator, plan_store_load
from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.routing import (LinearQuadraticPrefillCost, RoutingRequest, WorkerLoad,
                               build_prefill_router)
from deepinfer.routing.prefix_locator import PrefixLocator

COST = LinearQuadraticPrefillCost()
BS = 16
SYSTEM = list(range(100, 100 + 512))  # a 512-token shared system prompt


def load(wid: str, t: float = 0.0, store_rate: float | None = None) -> WorkerLoad:
    return WorkerLoad(wid, "prefill", t, predicted_queue_time_s=0.0,
                      store_load_s_per_token=store_rate)


def request(rid: str, suffix_seed: int, suffix_len: int = 48) -> RoutingRequest:
    prompt = SYSTEM + [5000 + suffix_seed * 97 + i for i in range(suffix_len)]
    return RoutingRequest(rid, len(prompt), hash_request_blocks(prompt, BS))


# --- cost model: load or recompute ------------------------------------------------------------

def test_plan_store_load_takes_the_cheaper_of_loading_and_recomputing():
    compute = lambda new, ctx: COST(new, ctx)  # noqa: E731
    fast = plan_store_load(560, 0, 32, BS, lambda k: 1e-6 * k * BS, compute)
    assert fast.num_load_blocks == 32 and fast.total_s < COST(560, 0)
    slow = plan_store_load(560, 0, 32, BS, lambda k: 1.0 + 1e-6 * k, compute)
    assert slow.num_load_blocks == 0 and slow.total_s == pytest.approx(COST(560, 0))
    # Device-cached head: only the blocks after it are candidates, and never the last token.
    head = plan_store_load(560, 256, 32, BS, lambda k: 0.0, compute)
    assert head.num_load_blocks == (560 - 256) // BS
    with pytest.raises(ValueError):
        plan_store_load(10, 0, 1, 0, lambda k: 0.0, compute)


def test_rate_estimator_follows_measurements_weighted_by_size():
    est = RateEstimator(prior_s_per_unit=1e-3, latency_s=0.01, typical_units=1000)
    assert est.seconds(0) == 0.0 and est.seconds(1000) == pytest.approx(0.01 + 1.0)
    est.observe(1000, 0.01 + 0.1)  # first measurement: at least half way from the prior
    assert est.s_per_unit < 0.6e-3
    for _ in range(40):
        est.observe(1000, 0.01 + 0.1)
    assert est.s_per_unit == pytest.approx(1e-4, rel=1e-3)
    before = est.s_per_unit
    est.observe(1, 0.01 + 1e-3)  # one tiny read, 10x slower per unit, barely moves it
    assert est.s_per_unit < before * 1.01
    with pytest.raises(ValueError):
        RateEstimator(prior_s_per_unit=-1.0)


# --- prefix locator ---------------------------------------------------------------------------

def test_locator_tracks_in_flight_then_stored_and_forgets_aborts_and_lost_workers():
    loc = PrefixLocator()
    a = request("a", 1).block_hashes
    b = request("b", 2).block_hashes  # shares the 32 system blocks with a
    loc.on_routed("a", "p0", a, eta=5.0)
    m = loc.match(b)
    assert m.num_stored_blocks == 0 and m.num_local_blocks("p0") == 32
    assert [(f.worker_id, f.num_blocks, f.eta) for f in m.in_flight] == [("p0", 32, 5.0)]
    loc.on_prefilled("a")
    m = loc.match(b)
    assert m.num_stored_blocks == 32 and m.num_local_blocks("p0") == 32 and not m.in_flight
    assert loc.match(a).num_stored_blocks == len(a)
    loc.on_routed("c", "p1", request("c", 3).block_hashes, eta=9.0)
    loc.on_aborted("c")
    assert not loc.match(request("c", 3).block_hashes).in_flight
    loc.on_worker_removed("p0")
    m = loc.match(b)
    assert m.num_local_blocks("p0") == 0 and m.num_stored_blocks == 32  # the store survives


def test_locator_is_bounded():
    loc = PrefixLocator(capacity_blocks=20)
    loc.on_routed("a", "p0", request("a", 1).block_hashes, eta=1.0)
    loc.on_prefilled("a")
    assert len(loc) == 20  # of 35


# --- routing ----------------------------------------------------------------------------------

def test_prefix_in_flight_is_reused_not_computed_twice():
    router = build_prefill_router("least-compute")
    loads = [load("p0"), load("p1")]
    first = request("a", 1)
    assert router.route(first, loads, 0.0) == "p0"
    full = router.reserved("p0").predicted_cost_s
    assert full == pytest.approx(COST(first.num_prompt_tokens, 0))
    second = request("b", 2)
    worker = router.route(second, loads, 0.0)
    reserved = router.reserved(worker).predicted_cost_s - (full if worker == "p0" else 0.0)
    # Only the suffix is computed: on p0 (it computes the prefix) or on p1 awaiting it.
    assert reserved < 0.25 * full
    plan = router.take_prefix_plan("b")
    if worker == "p1":
        assert plan is not None and plan.num_await_blocks == 32
        assert plan.await_until >= COST(first.num_prompt_tokens, 0)
    else:
        assert plan is None


def test_stored_prefix_spreads_over_workers_as_store_hits():
    router = build_prefill_router("least-compute")
    loads = [load("p0"), load("p1")]
    router.route(request("a", 1), loads, 0.0)
    router.on_prefill_done("a")  # published; p0 also has it on device
    # p0 is now busy; a request sharing the prefix goes to p1 and counts the prefix as
    # loaded from the store (cheap), not recomputed.
    loads = [WorkerLoad("p0", "prefill", 0.1, predicted_queue_time_s=1.0), load("p1", 0.1)]
    picks = router.route(request("b", 2), loads, 0.1)
    assert picks == "p1"
    assert router.reserved("p1").predicted_cost_s < 0.25 * COST(560, 0)


def test_slow_store_never_predicts_worse_than_recomputing():
    router = build_prefill_router("least-compute")
    slow = [load("p0", store_rate=1.0), load("p1", store_rate=1.0)]  # 1 s per token
    router.route(request("a", 1), slow, 0.0)
    router.on_prefill_done("a")
    slow = [WorkerLoad("p0", "prefill", 0.5, predicted_queue_time_s=1.0,
                       store_load_s_per_token=1.0), load("p1", 0.5, store_rate=1.0)]
    worker = router.route(request("b", 2), slow, 0.5)
    assert worker == "p1"  # p0 has the prefix on device but a long queue
    cost = router.reserved("p1").predicted_cost_s
    assert cost == pytest.approx(COST(560, 0))  # recompute, not a 512-second load


def test_aborted_in_flight_prefix_is_not_awaited():
    router = build_prefill_router("least-compute")
    loads = [load("p0"), load("p1")]
    router.route(request("a", 1), loads, 0.0)
    router.on_request_aborted("a", "p0")
    router.route(request("b", 2), loads, 0.0)
    assert router.take_prefix_plan("b") is None
    assert router.reserved("p0").predicted_cost_s + router.reserved("p1").predicted_cost_s \
        == pytest.approx(COST(560, 0))


def test_prefix_tracking_can_be_turned_off():
    router = build_prefill_router("least-compute", track_prefixes=False)
    loads = [load("p0"), load("p1")]
    assert [router.route(request(f"r{i}", i), loads, 0.0) for i in range(4)] == \
        ["p0", "p1", "p0", "p1"]


def test_locator_does_not_count_an_awaited_head_as_in_flight_on_the_awaiting_worker():
    loc = PrefixLocator()
    a, b = request("a", 1).block_hashes, request("b", 2).block_hashes
    loc.on_routed("a", "p0", a, eta=1.0)
    loc.on_routed("b", "p1", b, eta=1.5, num_await_blocks=32)  # waits for p0's 32 blocks
    m = loc.match(request("c", 3).block_hashes)
    # p1 computes none of the system prompt: a request queued there would not find it.
    assert m.num_local_blocks("p1") == 0 and m.num_local_blocks("p0") == 32
    assert [(f.worker_id, f.num_blocks) for f in m.in_flight] == [("p0", 32)]
    loc.on_prefilled("b")  # loaded: now on p1's device too
    assert loc.match(request("c", 3).block_hashes).num_local_blocks("p1") == 32


def test_request_behind_an_awaiting_one_awaits_too_instead_of_recomputing():
    # p0 computes the system prompt for a; b waits for it on p1. c must not be sent to p1
    # as if p1 held the prefix for free: p1 would admit c first (b is held for its read)
    # and compute the prefix a second time.
    router = build_prefill_router("least-compute")
    loads = [load("p0"), load("p1")]
    assert router.route(request("a", 1), loads, 0.0) == "p0"
    assert router.route(request("b", 2), loads, 0.0) == "p1"
    assert router.take_prefix_plan("b").await_worker == "p0"
    worker = router.route(request("c", 3), loads, 0.0)
    plan = router.take_prefix_plan("c")
    if worker == "p1":
        assert plan is not None and plan.num_await_blocks == 32 and plan.await_worker == "p0"
    else:
        assert plan is None  # queued behind a on p0, which computes the prefix
    assert router.num_awaited == 1 + (worker == "p1")


def test_a_planned_store_load_waits_briefly_for_a_just_published_prefix():
    # The router marks a prefix stored when its prefill is done; the store write of its
    # last chunk may still be landing when the next request reaches another worker. The
    # plan asks that worker to wait for the blocks, at most what recomputing them costs.
    router = build_prefill_router("least-compute", await_slack_s=1.0)
    loads = [load("p0"), load("p1")]
    router.route(request("a", 1), loads, 0.0)
    router.on_prefill_done("a")
    busy = [WorkerLoad("p0", "prefill", 0.1, predicted_queue_time_s=1.0), load("p1", 0.1)]
    assert router.route(request("b", 2), busy, 0.1) == "p1"
    plan = router.take_prefix_plan("b")
    assert plan is not None and plan.await_worker is None
    assert plan.num_load_blocks == 32 and plan.num_await_blocks == 32
    recompute_s = COST(560, 0) - COST(560 - 512, 512)
    assert 0.1 < plan.await_until <= 0.1 + recompute_s + 1e-9
    assert router.num_awaited == 0  # a metric of prefixes awaited while in flight only
    # A store too slow to load from: recomputed, nothing to wait for.
    slow = [WorkerLoad("p0", "prefill", 0.2, predicted_queue_time_s=1.0,
                       store_load_s_per_token=1.0), load("p1", 0.2, store_rate=1.0)]
    router.route(request("c", 3), slow, 0.2)
    assert router.take_prefix_plan("c") is None


def test_a_prefix_in_flight_is_never_computed_a_second_time_even_when_waiting_is_slower():
    # a's system prompt is being computed on p0 behind a 5 s queue. b shares it; p1 is idle,
    # and recomputing the prefix there would finish b sooner. b still waits for it (on p1,
    # loading it from the store once published), as the issue asks; only with
    # reuse_in_flight=False does the router trade the duplicate compute for b's latency.
    for reuse, awaited in ((True, True), (False, False)):
        router = build_prefill_router("least-compute", reuse_in_flight=reuse)
        slow_p0 = WorkerLoad("p0", "prefill", 0.0, predicted_queue_time_s=5.0)
        assert router.route(request("a", 1), [slow_p0], 0.0) == "p0"
        worker = router.route(request("b", 2), [slow_p0, load("p1")], 0.0)
        plan = router.last_plan
        assert (plan.num_local_blocks + plan.num_load_blocks == 32) is awaited
        if awaited and worker == "p1":
            wait = router.take_prefix_plan("b")
            assert wait.await_worker == "p0"
            eta = wait.finish_s - wait.own_cost_s  # when the prefix is predicted published
            assert eta > 5.0 and wait.await_until >= 2 * eta  # slack: the wait again
        if not awaited:
            assert worker == "p1" and router.take_prefix_plan("b") is None


def test_the_tail_computed_after_an_awaited_head_is_in_flight_for_the_next_turn():
    # Multi-turn: turn 2 (b) awaits the system prompt a computes on p0 and computes its own
    # message on p1. Turn 3 (c) extends b's prompt: all of b's blocks are coming to the
    # store (a's by a's eta, b's own by b's), so c can wait for all of them; before, the
    # awaited head hid b's tail and c computed it a second time.
    loc = PrefixLocator()
    b_prompt = SYSTEM + [7000 + i for i in range(64)]  # 36 full blocks
    c_prompt = b_prompt + [9000 + i for i in range(40)]
    loc.on_routed("a", "p0", request("a", 1).block_hashes, eta=1.0)
    loc.on_routed("b", "p1", hash_request_blocks(b_prompt, BS), eta=2.0, num_await_blocks=32)
    m = loc.match(hash_request_blocks(c_prompt, BS))
    assert m.num_local_blocks("p1") == 0  # the head is not computed there
    assert {(f.worker_id, f.num_blocks, f.eta) for f in m.in_flight} == \
        {("p0", 32, 1.0), ("p1", 36, 2.0)}

    router = build_prefill_router("least-compute")
    loads = [load("p0"), load("p1")]
    router.route(request("a", 1), loads, 0.0)
    assert router.route(RoutingRequest("b", len(b_prompt), hash_request_blocks(b_prompt, BS)),
                        loads, 0.0) == "p1"
    router.route(RoutingRequest("c", len(c_prompt), hash_request_blocks(c_prompt, BS)),
                 loads, 0.0)
    plan = router.last_plan
    assert plan.num_local_blocks + plan.num_load_blocks == 36  # none of b's blocks again
