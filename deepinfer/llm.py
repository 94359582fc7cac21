"""Offline API, vLLM-shaped: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from deepinfer.engine.engine_config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

PromptType = str | dict[str, Any]
# (prompt token ids, prompt text or None, images or None)
Encoded = tuple[list[int], str | None, Any]


class LLM:
    """Offline batch inference on one engine.

    `share_weights_with`: another LLM (same model and dtype) whose loaded weights and tokenizer
    this one reuses, e.g. to run several cache configurations without reloading the model."""

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", *,
                 share_weights_with: LLM | None = None, **engine_kwargs: Any) -> None:
        config = EngineConfig(model=model, dtype=dtype, **engine_kwargs)
        shared = {}
        if share_weights_with is not None:
            other = share_weights_with.engine
            if (other.config.model != model or other.config.dtype != dtype
                    or other.config.quantization != config.quantization):
                raise ValueError("share_weights_with needs the same model, dtype and quantization")
            shared = dict(source=other.source, model=other.model, tokenizer=other.tokenizer)
        self.engine = LLMEngine(config, **shared)
        self._counter = itertools.count()
        self._mm_processor = None

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._counter = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        encoded = []
        for conv in conversations:
            if self.engine.mm_images is not None:  # image_url / image parts, HF processor
                from deepinfer.multimodal.processor import load_message_images
                token_ids, mm_inputs = self._processor().process_chat(
                    load_message_images(conv), add_generation_prompt)
                encoded.append((token_ids, None, mm_inputs))
                continue
            text = tok.apply_chat_template(conv, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           **(chat_template_kwargs or {}))
            encoded.append((tok(text, add_special_tokens=False).input_ids, text, None))
        return self._run(encoded, sampling_params, use_tqdm)

    def _processor(self):
        """The checkpoint's multi-modal processor (loaded on first use)."""
        if getattr(self, "_mm_processor", None) is None:
            from deepinfer.multimodal.processor import MultiModalProcessor
            self._mm_processor = MultiModalProcessor.from_pretrained(self.engine.source.path)
        return self._mm_processor

    def _encode(self, prompt: PromptType) -> Encoded:
        if isinstance(prompt, str):
            return self.engine.tokenizer(prompt).input_ids, prompt, None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            images = prompt["multi_modal_data"].get("image")
            if "prompt" not in prompt or images is None:
                raise ValueError("multi_modal_data needs {'prompt': str, 'multi_modal_data': {'image': ...}}")
            if self.engine.mm_images is None:
                raise ValueError(f"model {self.engine.model_name} does not accept images")
            images = list(images) if isinstance(images, (list, tuple)) else [images]
            token_ids, mm_inputs = self._processor().process_prompt(prompt["prompt"], images)
            return token_ids, prompt["prompt"], mm_inputs
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"]), None, None
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.engine.tokenizer(prompt["prompt"]).input_ids, prompt["prompt"], None
        raise ValueError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [...]}")

    def _run(self, encoded: list[Encoded], sampling_params,
             use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(encoded)
        if len(sampling_params) != len(encoded):
            raise ValueError("need one SamplingParams per prompt (or a single one)")
        ids = []
        try:
            for (token_ids, text, mm_inputs), params in zip(encoded, sampling_params):
                request_id = str(next(self._counter))
                self.engine.add_request(request_id, token_ids, params, prompt=text,
                                        mm_inputs=mm_inputs)
                ids.append(request_id)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return self._drain(ids, use_tqdm)

    def _drain(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
        streaming = self.engine.stream_outputs
        self.engine.stream_outputs = False  # only finished outputs are read here
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            self.engine.stream_outputs = streaming
            if bar is not None:
                bar.close()
        failed = {f.request_id: f.message for f in self.engine.take_request_failures()}
        for request_id in ids:
            if request_id not in finished:
                raise RuntimeError(failed.get(request_id, f"request {request_id} did not finish"))
        return [finished[i] for i in ids]
