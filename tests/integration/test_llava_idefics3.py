"""Idefics3 (SmolVLM-shaped) offline: each image becomes 2x2 crops + a global view, each crop
its own placeholder; greedy tokens equal transformers fp32 for one and two images, and the
same image again is a prefix hit."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from tests.integration.llava_checkpoints import hf_greedy, hf_idefics3, synthetic_image, write_tiny_idefics3

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory, default_model_source):
    directory = write_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3")),
                                    copy.deepcopy(default_model_source.load_tokenizer()))
    return LLM(model=directory, dtype="float32", num_kv_blocks=64, block_size=16, seed=0), hf_idefics3(directory)


def _chat(*images, text="Describe."):
    parts = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def test_idefics3_crops_match_transformers_and_repeat_is_a_prefix_hit(idefics3):
    llm, hf = idefics3
    conversations = [_chat(synthetic_image(1, (60, 44))), _chat(synthetic_image(2, (20, 30)), synthetic_image(3))]
    outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
    for conv, out in zip(conversations, outputs):
        token_ids, mm = llm._processor().process_chat(conv)
        assert out.prompt_token_ids == token_ids
        assert len(mm.placeholders) == len(mm.pixel_values) > len(conv[0]["content"]) - 1  # crops
        pixels = np.stack([p.to_numpy() for p in mm.pixel_values])[None]  # [1, crops, 3, H, W]
        assert out.outputs[0].token_ids == hf_greedy(hf, token_ids, pixels, MAX_TOKENS)
    again, = llm.chat(conversations[0], GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 > 0
    assert again.outputs[0].token_ids == outputs[0].outputs[0].token_ids
