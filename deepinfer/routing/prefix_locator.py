"""`PrefixLocator`: where the front believes each prefix block is. Pure.

Built only from the router's own decisions and completions, never from the store:

    on_routed(request, worker, eta)   its blocks are *in flight* on that worker until eta
                                      (except a head it awaits: another worker computes it)
    on_prefilled(request)             computed: published to the shared store, and in that
                                      worker's device cache
    on_aborted(request)               in flight no more; nothing was published

Keys are chained block hashes, so one hash names a whole prefix. A hint, bounded (least
recently seen blocks forgotten first): a block believed stored may have been evicted, and a
worker's device cache may have dropped it; the prefill worker's own lookup is the truth.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Block:
    stored: bool = False
    device_workers: set[str] = field(default_factory=set)  # computed there (likely cached)
    in_flight: dict[str, tuple[str, float]] = field(default_factory=dict)  # req -> (worker, eta)


@dataclass(frozen=True)
class InFlightPrefix:
    """`num_blocks` leading blocks of a request being computed on `worker_id`, published
    (stored) by about `eta` (router clock)."""

    worker_id: str
    num_blocks: int
    eta: float


@dataclass(frozen=True)
class PrefixMatch:
    """What is known of one request's leading blocks.

    `num_stored_blocks`: leading blocks in the shared store. `device_blocks[w]`: leading
    blocks worker w holds on its device or is computing now (free for it). `in_flight`: per
    worker w computing some of them now, the longest leading run that will all be in the
    store once w's blocks are published (its other blocks stored already or computed by
    others: a head w awaits), with when the whole run is expected."""

    num_stored_blocks: int
    device_blocks: dict[str, int]
    in_flight: tuple[InFlightPrefix, ...]

    def num_local_blocks(self, worker_id: str) -> int:
        return self.device_blocks.get(worker_id, 0)


class PrefixLocator:
    def __init__(self, capacity_blocks: int = 1 << 18) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._requests: dict[str, tuple[str, tuple[bytes, ...]]] = {}  # req -> (worker, hashes)

    def __len__(self) -> int:
        return len(self._blocks)

    def on_routed(self, request_id: str, worker_id: str, block_hashes: Sequence[bytes],
                  eta: float, num_await_blocks: int = 0) -> None:
        """`num_await_blocks`: leading blocks the request waits for in the store while
        another worker computes them. They are not in flight on `worker_id`: a request
        queued behind it there would find them only after the wait, not for free (it
        would be admitted first and compute them a second time)."""
        self.on_aborted(request_id)  # a retry replaces the earlier placement
        hashes = tuple(block_hashes)
        self._requests[request_id] = (worker_id, hashes)
        for block_hash in hashes[num_await_blocks:]:
            self._block(block_hash).in_flight[request_id] = (worker_id, eta)
        self._trim()

    def on_prefilled(self, request_id: str) -> None:
        placed = self._requests.pop(request_id, None)
        if placed is None:
            return
        worker_id, hashes = placed
        for block_hash in hashes:
            block = self._block(block_hash)
            block.in_flight.pop(request_id, None)
            block.stored = True
            block.device_workers.add(worker_id)
        self._trim()

    def on_aborted(self, request_id: str) -> None:
        placed = self._requests.pop(request_id, None)
        if placed is None:
            return
        for block_hash in placed[1]:
            block = self._blocks.get(block_hash)
            if block is not None:
                block.in_flight.pop(request_id, None)

    def on_worker_removed(self, worker_id: str) -> None:
        """A lost or restarted worker: its device cache and in-flight work are gone."""
        for request_id, (wid, _) in list(self._requests.items()):
            if wid == worker_id:
                self.on_aborted(request_id)
        for block in self._blocks.values():
            block.device_workers.discard(worker_id)

    def match(self, block_hashes: Sequence[bytes]) -> PrefixMatch:
        """Walk the request's chain while anything is known of it."""
        num_stored = 0
        stored_run = True
        device: dict[str, int] = {}
        alive: set[str] | None = None  # workers whose local run is still unbroken
        flight: dict[str, InFlightPrefix] = {}
        coming = True  # every block so far is stored or being computed
        coming_eta = 0.0  # when the unstored ones among them are expected
        for i, block_hash in enumerate(block_hashes):
            block = self._blocks.get(block_hash)
            if block is None:
                break
            if stored_run and block.stored:
                num_stored = i + 1
            else:
                stored_run = False
            local = block.device_workers | {w for w, _ in block.in_flight.values()}
            alive = local if alive is None else alive & local
            for w in alive:
                device[w] = i + 1
            etas: dict[str, float] = {}
            for w, eta in block.in_flight.values():
                etas[w] = min(eta, etas.get(w, eta))
            coming = coming and (block.stored or bool(etas))
            if coming:
                if not block.stored:
                    coming_eta = max(coming_eta, min(etas.values()))
                for w, eta in etas.items():
                    flight[w] = InFlightPrefix(w, i + 1, coming_eta if block.stored
                                               else max(coming_eta, eta))
            if not (stored_run or alive or coming):
                break
            self._blocks.move_to_end(block_hash)
        return PrefixMatch(num_stored, device,
                           tuple(sorted(flight.values(), key=lambda f: f.worker_id)))

    def _block(self, block_hash: bytes) -> _Block:
        block = self._blocks.get(block_hash)
        if block is None:
            block = self._blocks[block_hash] = _Block()
        else:
            self._blocks.move_to_end(block_hash)
        return block

    def _trim(self) -> None:
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
