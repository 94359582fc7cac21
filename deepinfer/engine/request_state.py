"""Front-side state of one user request: its n sequences, detokenizers and metrics."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.core.scheduler_output import PromptLogprobs, PromptLogprobsChunk, TokenLogprobs
from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.engine.outputs import (CompletionOutput, RequestMetrics, RequestOutput,
                                      prompt_logprob_entry)
from deepinfer.sampling_params import SamplingParams


@dataclass
class SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput

    def append_tokens(self, token_ids: list[int], logprobs: list[TokenLogprobs],
                      ends: bool, ends_on_stop_token: bool) -> str | None:
        """Append one step's tokens (several when drafts were accepted) one at a time, as if
        each came from its own step, so stop strings and text cut exactly where they would
        without speculation. Returns the stop string that ended the sequence (the tokens after
        it are dropped: the caller finishes the sequence), else None. `ends`: the scheduler
        finished the sequence with this step's last token (`ends_on_stop_token`: a stop token,
        whose text is left out)."""
        output = self.output
        for i, token_id in enumerate(token_ids):
            last = i == len(token_ids) - 1
            output.token_ids.append(token_id)
            if i < len(logprobs) and output.logprobs is not None:
                output.logprobs.append(logprobs[i])
                output.cumulative_logprob += logprobs[i].logprob
            # A sequence ending here flushes held-back text.
            stop = self.detokenizer.add_tokens([token_id], final=last and ends,
                                               stop_token=last and ends_on_stop_token)
            output.text = self.detokenizer.text
            if stop is not None and output.finish_reason is None:
                output.finish_reason, output.stop_reason = "stop", stop
                return stop
        return None


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    prompt: str | None = None
    sequences: dict[str, SequenceState] = field(default_factory=dict)  # child id -> state
    num_cached_tokens: int = 0
    # Prompt log-probs: complete (vLLM-shaped) once the last prompt chunk ran; until then the
    # rows computed so far, by prompt position.
    prompt_logprobs: PromptLogprobs | None = None
    _prompt_rows: list[TokenLogprobs | None] | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and len(self.prompt_token_ids) == 1:
            self.prompt_logprobs = [None]  # nothing to compute

    def add_prompt_logprobs(self, chunk: PromptLogprobsChunk, token_text) -> None:
        """Record one chunk's rows; a recomputed chunk (after a preemption) overwrites its
        positions, and nothing changes once the prompt is complete (n > 1 children each
        compute it). `token_text(token_id)` gives the text of a token."""
        if self.prompt_logprobs is not None:
            return
        num_prompt = len(self.prompt_token_ids)
        if self._prompt_rows is None:
            self._prompt_rows = [None] * num_prompt
        end = chunk.first_position + len(chunk.logprobs)
        if chunk.first_position < 1 or end > num_prompt:
            raise ValueError(f"prompt log-probs for positions {chunk.first_position}..{end} of "
                             f"a {num_prompt}-token prompt")
        self._prompt_rows[chunk.first_position:end] = chunk.logprobs
        if end == num_prompt:
            rows, self._prompt_rows = self._prompt_rows, None
            if any(row is None for row in rows[1:]):
                raise ValueError("prompt log-probs are missing for some prompt positions")
            self.prompt_logprobs = [None] + [prompt_logprob_entry(row, token_text)
                                             for row in rows[1:]]

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
                             self.num_cached_tokens, self.metrics, self.prompt,
                             self.prompt_logprobs)
