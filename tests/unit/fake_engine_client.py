"""A stand-in for `EngineClient` behind the real app: a character tokenizer and an engine
that answers every prompt with the prompt's own first tokens (so a test can check which
tokens a request got). `gate`, when set, holds every generation until it is set."""
from __future__ import annotations

import asyncio

from deepinfer.wire.engine_messages import ChoiceDelta, EngineStatsSnapshot, RequestDelta

VOCAB = 100


class CharTokenizer:
    def __init__(self) -> None:
        self.on_encode = None  # called with the text before encoding (tests hook threads here)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.on_encode is not None:
            self.on_encode(text)
        return [10 + (ord(c) % 80) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(32 + t % 90) for t in ids)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [chr(32 + t % 90) for t in ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False,
                            **template_vars):  # as HF's: extra variables go to the template
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ">"


class FakeEngineClient:
    model_name, max_model_len, vocab_size = "m", 64, VOCAB
    is_healthy, dead_message, num_waiting_requests = True, None, 0
    stats = EngineStatsSnapshot()

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer()
        self.gate: asyncio.Event | None = None
        self.requests: list[tuple[list[int], object]] = []

    async def generate(self, request_id, prompt_token_ids, params, arrival_time=None,
                       mm_inputs=None):
        self.requests.append((list(prompt_token_ids), params))
        if self.gate is not None:
            await self.gate.wait()
        tokens = [t % VOCAB for t in prompt_token_ids[:params.max_tokens]]
        for token in tokens[:-1]:
            yield RequestDelta(request_id, [ChoiceDelta(i, self.tokenizer.decode([token]),
                                                        [token]) for i in range(params.n)],
                               finished=False)
            await asyncio.sleep(0)
        yield RequestDelta(request_id, [ChoiceDelta(i, self.tokenizer.decode(tokens[-1:]),
                                                    tokens[-1:], finish_reason="length")
                                        for i in range(params.n)], finished=True)
