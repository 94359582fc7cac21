"""`StagingBudget`: caps the host memory a prefill worker holds for decode pulls.

A prefill worker copies each finished prompt's KV to host memory (staging) until a decode
worker pulls it. Staged bytes are known only after the prefill, so the cap is kept at
admission: a prompt enters the engine only while staged bytes + the staging already promised
to admitted prompts + its own need fit in `capacity_bytes`; otherwise it waits in the
worker's queue (FIFO) and the worker reports its staging as full, so the prefill router
sends new prompts elsewhere. A prompt that alone exceeds the cap is admitted when nothing
else is staged or promised (it would otherwise never run). Plain bookkeeping, no IO.
"""
from __future__ import annotations


class StagingBudget:
    def __init__(self, capacity_bytes: int, bytes_per_block: int, block_size: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the KV staging capacity must be >= 1 byte, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.bytes_per_block = bytes_per_block
        self.block_size = block_size
        self._promised: dict[str, int] = {}  # admitted request -> staging bytes it will need

    def need(self, num_prompt_tokens: int) -> int:
        """Bytes a prompt's staged KV takes: its blocks, the last one partly filled."""
        return -(-num_prompt_tokens // self.block_size) * self.bytes_per_block

    @property
    def promised_bytes(self) -> int:
        return sum(self._promised.values())

    def can_admit(self, need: int, staged_bytes: int) -> bool:
        held = staged_bytes + self.promised_bytes
        return held + need <= self.capacity_bytes or held == 0

    def promise(self, request_id: str, need: int) -> None:
        self._promised[request_id] = need

    def release(self, request_id: str) -> None:
        """The request was staged (its bytes now count as staged), finished or aborted."""
        self._promised.pop(request_id, None)

    def used_bytes(self, staged_bytes: int) -> int:
        return staged_bytes + self.promised_bytes
