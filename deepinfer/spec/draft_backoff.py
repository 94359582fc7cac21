"""Back-off for drafting where drafts keep being rejected. Pure.

A verification of k drafts costs a step with 1 + k tokens per request; when none is accepted
that is pure loss (on a CPU at batch 16, half the throughput). After m verifications in a row
that accepted nothing, a request skips drafting for min(2^(m-1), max_skip) steps (plain decode
steps); any accepted draft resets it. Which steps draft never changes the output.
"""
from __future__ import annotations

from collections.abc import Iterable


class DraftBackoff:
    def __init__(self, max_skip: int = 8) -> None:
        self.max_skip = max_skip
        self._misses: dict[str, int] = {}  # verifications in a row with nothing accepted
        self._skip: dict[str, int] = {}  # steps left without drafts

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts accepted `num_accepted` of them."""
        if num_drafts == 0:
            return
        if num_accepted > 0:
            self._misses.pop(request_id, None)
            return
        misses = self._misses[request_id] = self._misses.get(request_id, 0) + 1
        self._skip[request_id] = min(2 ** (misses - 1), self.max_skip)

    def allow(self, request_id: str) -> bool:
        """Whether `request_id` drafts this step (counts down a skip)."""
        left = self._skip.get(request_id, 0)
        if left <= 0:
            return True
        self._skip[request_id] = left - 1
        return False

    def remove(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._misses.pop(request_id, None)
            self._skip.pop(request_id, None)
