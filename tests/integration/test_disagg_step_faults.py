"""Step faults inside disaggregated workers, on real engines in this process (the session's
model, fp32), their loops stepped by hand (no sockets, no timing).

- Prefill worker: a step that fails after writing part of one request's KV (here: the step
  leaves NaN where that request's chunk went) fails that request alone. The request batched
  with it is undone and recomputed (its first token equals the fault-free one); nothing the
  failed step wrote reaches the shared store, the device prefix cache or a hand-off: the
  same prompt sent again is recomputed exactly, and every stored or staged block is finite.
- Decode worker: an engine fault (pinned on no single request) fails every request in flight,
  transfers in progress included; a pull for such a transfer that completes afterwards must
  never be written into its freed blocks (another request holds them by then).
"""
from __future__ import annotations

import time

import pytest
import torch

from deepinfer.cluster.decode_engine import DisaggDecodeEngine
from deepinfer.cluster.decode_worker import DecodeWorkerLoop
from deepinfer.cluster.kv_transport import KVFetchResult, ZmqKVTransport
from deepinfer.wire.worker_messages import DecodeRequest, PrefillRequest
from deepinfer.cluster.prefill_worker import PrefillWorkerLoop
from deepinfer.cluster.prefix_store_tier import SharedPrefixTier, layout_for_cache
from deepinfer.cluster.worker_spec import WorkerSpec
from deepinfer.core.prefix_hash import salt_hash
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.engine.step_faults import isolate_step_faults
from deepinfer.kvstore.memory_store import MemoryKVBlockStore
from deepinfer.kvstore.tensor_codec import kv_block_from_bytes
from deepinfer.sampling_params import SamplingParams
from tests.integration.engine_checks import token_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BS = 16
CHUNK = 64  # prefill tokens per step
DEADLINE_S = 60.0  # bound on any loop below (never reached when the code works)
FIRST = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    """One thread, as the workers under test run (and much faster on a busy 2-core box)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 20000 for i in range(n)]


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# --- prefill worker ---------------------------------------------------------------------------

@pytest.fixture
def prefill(make_engine_llm):
    engine = make_engine_llm(num_kv_blocks=64, max_num_batched_tokens=CHUNK).engine
    isolate_step_faults(engine, "prefill")  # as worker_proc builds it
    transport = ZmqKVTransport(serve=True)
    store = MemoryKVBlockStore(salt_hash("prefill-step-faults"))
    tier = SharedPrefixTier(store, engine.cache, engine.scheduler.kv, layout_for_cache(engine.cache))
    spec = WorkerSpec("prefill-0", "prefill", engine.config, "", "")
    worker = PrefillWorkerLoop(spec, engine, None, None, transport, tier)
    yield worker
    worker.prefetcher.close()
    tier.writer.close(timeout_s=5.0)
    transport.close()


def step(worker) -> None:
    worker.before_step()
    if worker.has_step_work():
        worker.after_step(worker.engine.step())


def admit(worker, request_id: str, ids: list[int]) -> None:
    worker.handle(PrefillRequest(request_id, ids, FIRST, 0.0))
    deadline = time.monotonic() + DEADLINE_S
    while request_id not in worker.engine.scheduler.requests:  # its store read finishes
        assert time.monotonic() < deadline, f"{request_id} never admitted"
        worker.before_step()


def handed_off(worker, request_ids: set[str]) -> dict[str, int]:
    """Step until every request in `request_ids` hands off: {id: first token}."""
    deadline = time.monotonic() + DEADLINE_S
    while not request_ids <= {d.request_id for d in worker._prefill_done}:
        assert time.monotonic() < deadline, "no hand-off"
        step(worker)
        worker.engine.scheduler.check_invariants()
    return {d.request_id: d.first_token_id for d in worker._prefill_done}


def test_a_failed_prefill_step_publishes_and_hands_off_nothing_it_wrote(prefill, engine_base_llm,
                                                                      monkeypatch):
    worker, engine = prefill, prefill.engine
    long_prompt = prompt(1, 6 * BS + 5)  # two chunks: 64 tokens, then 37 with the short one
    short_prompt = prompt(2, 20)
    want_long, want_short = (t[0] for t in greedy(engine_base_llm, [long_prompt, short_prompt], 1))
    hashes = worker.tier.block_hashes(long_prompt)
    execute = engine.runner.execute
    num_faults = []

    def fails_after_writing(output):  # "c"'s second chunk: the step writes, then raises
        result = execute(output)
        c = engine.scheduler.requests.get("c")
        if c is not None and c.num_computed_tokens >= CHUNK and \
                any(s.request_id == "c" for s in output.scheduled):
            written = engine.scheduler.kv.block_ids("c")[CHUNK // BS:]
            garbage = torch.full_like(engine.cache.read_blocks(written), float("nan"))
            engine.cache.write_blocks(written, garbage)
            num_faults.append(len(output.scheduled))
            raise RuntimeError("device fault after writing")
        return result

    monkeypatch.setattr(engine.runner, "execute", fails_after_writing)
    admit(worker, "c", long_prompt)
    step(worker)  # c's first chunk: blocks 0-3, published
    assert worker.counters.store_blocks_published == 4 and not num_faults
    admit(worker, "a", short_prompt)
    step(worker)  # c's second chunk and all of a in one step: it fails, pinned on c
    assert num_faults[0] == 2  # the batch, then c alone (a alone ran fine)
    [error] = worker._errors
    assert (error.request_id, error.failed, error.engine_fault) == ("c", True, False)
    assert "device fault after writing" in error.message
    assert "c" not in worker._prefilling  # its staging promise is released: only a's left
    assert worker.staging.promised_bytes == worker.staging.need(len(short_prompt))
    assert engine.num_failed_steps == 1

    monkeypatch.setattr(engine.runner, "execute", execute)
    assert handed_off(worker, {"a"})["a"] == want_short  # a, undone, recomputed exactly
    admit(worker, "c-again", long_prompt)  # c's head is cached; its failed blocks must not be
    assert handed_off(worker, {"c-again"})["c-again"] == want_long
    assert worker.tier.writer.flush(DEADLINE_S)
    store, layout = worker.tier.store, worker.tier.layout
    assert all(store.contains(h) for h in hashes)  # published when computed for c-again
    for block_hash in hashes:
        block = kv_block_from_bytes(store.get(block_hash), layout, torch.device("cpu"))
        assert torch.isfinite(block).all(), "a failed step's KV reached the store"
    for request_id, ids in (("a", short_prompt), ("c-again", long_prompt)):
        staged, _ = worker.transport._staged.pop(request_id)  # as if pulled
        slots = staged.flatten(2, 3)[:, :, :len(ids)]  # [L, 2, tokens, H, D]: the prompt's
        assert torch.isfinite(slots).all(), f"a failed step's KV handed off for {request_id}"
    assert [e.request_id for e in worker._errors] == ["c"]
    assert engine.scheduler.kv.pool.num_used_blocks == 0


# --- decode worker ----------------------------------------------------------------------------

class FakeTransport:
    """The decode side of `KVTransport` with pulls completed by the test: a cancelled
    fetch's result is discarded, as the contract says."""

    def __init__(self) -> None:
        self.fetching: set[str] = set()
        self.cancelled: set[str] = set()
        self.results: list[KVFetchResult] = []

    def fetch(self, request_id: str, source_addr: str, timeout_s: float) -> None:
        self.fetching.add(request_id)
        self.cancelled.discard(request_id)

    def cancel_fetch(self, request_id: str) -> None:
        self.cancelled.add(request_id)

    def complete(self, request_id: str, kv: torch.Tensor) -> None:
        self.results.append(KVFetchResult(request_id, kv, kv.numel() * kv.element_size(), 0.0))

    def poll(self) -> list[KVFetchResult]:
        out = [r for r in self.results if r.request_id not in self.cancelled]
        self.results = []
        return out


def prefilled(llm, ids: list[int]) -> tuple[torch.Tensor, int]:
    """(prompt KV as `read_blocks` gives it, first token) from a colocated engine."""
    engine = llm.engine
    engine.add_request("pre", ids, FIRST)
    first = []
    while not first:
        first = [o.outputs[0].token_ids[0] for o in engine.step()]
    kv = engine.cache.read_blocks(engine.scheduler.kv.block_ids("pre"))
    engine.abort_request(["pre"])
    return kv, first[0]


def test_a_pull_completing_after_an_engine_fault_is_not_written_into_freed_blocks(
        make_engine_llm, engine_base_llm, monkeypatch):
    base = engine_base_llm.engine
    decode = DisaggDecodeEngine(EngineConfig(model=None, dtype="float32", num_kv_blocks=9,
                                             block_size=BS),
                                source=base.source, model=base.model, tokenizer=base.tokenizer)
    isolate_step_faults(decode, "decode")
    transport = FakeTransport()
    loop = DecodeWorkerLoop(WorkerSpec("decode-0", "decode", decode.config, "", ""), decode,
                            None, None, transport)
    ids = prompt(3, 2 * BS + 3)  # 3 blocks a request: three fill the cache
    kv, first = prefilled(make_engine_llm(num_kv_blocks=16), ids)
    (want,) = greedy(engine_base_llm, [ids], 4)

    def send(request_id: str) -> None:
        loop.handle(DecodeRequest(request_id, ids, FIRST, 0.0, first, None, 0, "tcp://fake",
                                  kv.numel() * kv.element_size()))
        loop.before_step()  # allocated, pull started
        assert request_id in transport.fetching

    for request_id in ("run-1", "run-2"):
        send(request_id)
        transport.complete(request_id, kv)
        loop.before_step()  # written, admitted
    send("pulling")

    def device_lost(output):
        raise RuntimeError("device lost")

    execute = decode.runner.execute
    monkeypatch.setattr(decode.runner, "execute", device_lost)
    loop.after_step(decode.step())  # every request fails alone: an engine fault
    monkeypatch.setattr(decode.runner, "execute", execute)
    assert sorted((e.request_id, e.failed, e.engine_fault) for e in loop._errors) == [
        ("pulling", True, True), ("run-1", True, True), ("run-2", True, True)]
    assert decode.scheduler.kv.pool.num_used_blocks == 0

    # New requests take every block, the failed transfer's among them; then its pull
    # completes (a payload that is not this prompt's KV): it must be dropped, not written.
    nexts = [f"next-{i}" for i in range(3)]
    for request_id in nexts:
        send(request_id)
        transport.complete(request_id, kv)
    transport.complete("pulling", torch.full_like(kv, float("nan")))
    loop.before_step()
    assert decode.scheduler.kv.pool.num_free_blocks == 0
    tokens = {}
    deadline = time.monotonic() + DEADLINE_S
    while decode.has_unfinished_requests():
        assert time.monotonic() < deadline, "decode did not finish"
        for out in decode.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        decode.scheduler.check_invariants()
    assert tokens == {request_id: want for request_id in nexts}
    assert decode.scheduler.kv.pool.num_used_blocks == 0
