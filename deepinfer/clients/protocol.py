"""`EngineClient`: what the HTTP front (server/) uses of the engines behind it.

Every deployment shape implements it: one colocated engine process (`colocated`), data-parallel
rank groups (`data_parallel`), prefill/decode workers (`disagg`) and P/D with expert-parallel
decode groups (`ep_disagg`); `factory.make_client` picks one. The front calls nothing else,
so a shape can change its processes and sockets without the front knowing.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from deepinfer.wire.mm_inputs import MultiModalInputs
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.wire.engine_messages import EngineStatsSnapshot, RequestDelta


@runtime_checkable
class EngineClient(Protocol):
    """The front's view of its engines (members are read after `start()` returned)."""

    model_name: str
    """The served model's name, as its engines loaded it."""
    max_model_len: int
    """Longest prompt + output, in tokens."""
    vocab_size: int
    """Size of the model's vocabulary (bounds token ids and top-k in requests)."""
    tokenizer: Any
    """The model's tokenizer, loaded by the front from the files the first engine sent."""
    dead_message: str | None
    """Why nothing can be served now (None while healthy)."""
    supports_prompt_logprobs: bool
    """Whether `generate` returns prompt log-probs when the params ask for them."""

    async def start(self) -> None:
        """Start the engines and wait until they serve; raises EngineDeadError if they cannot."""

    async def shutdown(self) -> None:
        """Stop every engine process and close every socket."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, mm_inputs: MultiModalInputs | None = None,
                 ) -> AsyncIterator[RequestDelta]:
        """Yield the request's deltas until it finishes; aborts it in the engines on early exit."""

    async def abort(self, request_ids: list[str]) -> None:
        """Free the engines' state for these requests (unknown ids are ignored)."""

    @property
    def is_healthy(self) -> bool:
        """Whether a new request can be served now (/health)."""

    @property
    def stats(self) -> EngineStatsSnapshot:
        """Gauges of the live engines and counters that never go back (/metrics)."""

    @property
    def num_waiting_requests(self) -> int:
        """Requests accepted but not yet running (the admission gate's queue length)."""

    def register_metrics(self, registry) -> None:
        """Add this shape's own collectors to the front's Prometheus registry."""


@runtime_checkable
class ScalableClient(EngineClient, Protocol):
    """A client whose workers can be added and removed while it serves (the admin API)."""

    async def scale(self, role: str, count: int, wait: bool = True) -> dict:
        """Run `count` workers of `role` (removed ones drain first); what changed, as JSON."""

    def describe_workers(self) -> list[dict]:
        """Each worker's role, state and placement."""
