"""One simulated request's record: where it went and when each token appeared. Pure."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.bench.latency_stats import RequestResult


@dataclass
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float
    token_times_s: list[float] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prefix hit at first schedule (device + store)
    num_store_tokens: int = 0  # of those, loaded from the shared store
    prefill_worker: str | None = None
    decode_worker: str | None = None
    finished_s: float | None = None
    error: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    # P/D: the first decode gap's parts (prefill token -> handed off -> KV transfer started ->
    # admitted on the decode worker -> its first decode token, token_times_s[1])
    handoff_s: float | None = None
    transfer_start_s: float | None = None
    admitted_s: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def done(self) -> bool:
        return self.finished_s is not None or self.error is not None

    def to_result(self) -> RequestResult:
        """As `deepinfer bench serve` records a request (times from the run's start)."""
        times = self.token_times_s
        ok = self.error is None and self.finished_s is not None and bool(times)
        result = RequestResult(success=ok, prompt_len=self.prompt_len, output_len=len(times),
                               start_s=self.arrival_s, cached_tokens=self.num_cached_tokens,
                               error=self.error if not ok else None)
        if ok:
            result.ttft_s = times[0] - self.arrival_s
            result.e2e_s = times[-1] - self.arrival_s
            result.itl_s = [b - a for a, b in zip(times, times[1:])]
            result.token_times_s = list(times)
        elif result.error is None:
            result.error = "did not finish"
        return result
