"""A sequence must fit the KV cache: max_model_len never exceeds what the cache holds.

Before, a request that outgrew the whole cache ended with finish_reason "length" and fewer tokens
than it was allowed (a silently short answer)."""
import pytest

from deepinfer import SamplingParams

pytestmark = pytest.mark.slow


def test_max_model_len_is_lowered_to_the_cache(make_engine_llm):
    llm = make_engine_llm(num_kv_blocks=4, block_size=16, enable_prefix_caching=False)
    assert llm.engine.max_model_len == 64
    prompt = list(range(100, 120))  # 20 tokens
    with pytest.raises(ValueError, match="maximum context length of 64"):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=60, ignore_eos=True))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=44, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 44
    assert out[0].outputs[0].finish_reason == "length"


def test_explicit_max_model_len_beyond_the_cache_is_refused(make_engine_llm):
    with pytest.raises(ValueError, match="larger than the KV cache"):
        make_engine_llm(num_kv_blocks=4, block_size=16, max_model_len=100)
