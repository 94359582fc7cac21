"""Offline generation asks the engine for finished outputs only (no per-step
snapshot of every running request); streaming callers still get every step's outputs, and
the final outputs are the same either way. A stand-in model (next token = last token + 1)
keeps this about the engine loop, not the model."""
from __future__ import annotations

import torch

from deepinfer.engine.engine_config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams


class CountingModel(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, input_ids, positions, attn, input_embeds=None):
        return input_ids.float().unsqueeze(1)  # [T, 1]: the token id itself

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], self.config.vocab_size)
        logits[torch.arange(hidden.shape[0]), (hidden[:, 0].long() + 1) % 1000 + 100] = 1.0
        return logits


_TOKENIZER = []


def _engine(source) -> LLMEngine:
    if not _TOKENIZER:  # loaded once for the module's engines
        _TOKENIZER.append(source.load_tokenizer())
    return LLMEngine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64),
                     source=source, model=CountingModel(source.config), tokenizer=_TOKENIZER[0])


def _add(engine):
    for i, n in enumerate((3, 6, 1)):
        engine.add_request(f"r{i}", [100 + 7 * i, 200 + i], SamplingParams(temperature=0.0, max_tokens=n,
                                                                           ignore_eos=True))


def test_finished_only_outputs_equal_streamed_finals(default_model_source):
    streamed, finals_only = _engine(default_model_source), _engine(default_model_source)
    finals_only.stream_outputs = False
    _add(streamed)
    _add(finals_only)
    got_streamed, got_final = {}, {}
    num_unfinished_streamed = 0
    while streamed.has_unfinished_requests() or finals_only.has_unfinished_requests():
        for out in streamed.step():
            num_unfinished_streamed += not out.finished
            if out.finished:
                got_streamed[out.request_id] = out
        for out in finals_only.step():
            assert out.finished and out.request_id not in got_final
            got_final[out.request_id] = out
    assert num_unfinished_streamed > 0  # streaming returned running requests' outputs
    assert sorted(got_final) == sorted(got_streamed) == ["r0", "r1", "r2"]
    for rid, out in got_final.items():
        a, b = out.outputs[0], got_streamed[rid].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


def test_llm_generate_restores_streaming(default_model_source):
    engine = _engine(default_model_source)
    llm = LLM.from_engine(engine)
    outs = llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [9]}],
                        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[107, 208, 309, 410], [110, 211, 312, 413]]
    assert engine.stream_outputs is True
