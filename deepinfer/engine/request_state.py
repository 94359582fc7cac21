"""Front-side state of one user request: its n sequences, detokenizers and metrics."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer.sampling_params import SamplingParams


@dataclass
class SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    prompt: str | None = None
    sequences: dict[str, SequenceState] = field(default_factory=dict)  # child id -> state
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.output.finished for s in self.sequences.values())

    def to_output(self, finished: bool | None = None) -> RequestOutput:
        """`finished`: `self.finished` when the caller has it already."""
        finished = self.finished if finished is None else finished
        outputs = sorted((s.output for s in self.sequences.values()), key=lambda o: o.index)
        # Copies: callers keep cumulative snapshots while the engine keeps appending.
        snapshot = [CompletionOutput(o.index, o.text, list(o.token_ids), o.finish_reason,
                                     o.stop_reason, list(o.logprobs) if o.logprobs is not None
                                     else None, o.cumulative_logprob) for o in outputs]
        return RequestOutput(self.request_id, self.prompt_token_ids, snapshot, finished,
                             self.num_cached_tokens, self.metrics, self.prompt)
