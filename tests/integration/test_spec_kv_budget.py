"""`--kv-cache-memory` bounds the target's KV cache and the drafter's together: a draft model (here the default model drafting for itself, whose KV per block equals
the target's) gets one draft block per target block, so the budget buys half the blocks, and
the split is logged at start-up. n-gram drafts keep no KV and leave the budget to the target."""
from __future__ import annotations

import logging

import pytest

from deepinfer.runtime.kv_cache import parse_memory

pytestmark = pytest.mark.slow

BUDGET = "8MiB"


def cache_bytes(cache) -> int:
    return cache.kv.numel() * cache.kv.element_size()


def test_draft_model_kv_is_inside_the_kv_cache_memory(make_engine_llm, caplog):
    with caplog.at_level(logging.INFO, logger="deepinfer.engine"):  # engine start logs there
        llm = make_engine_llm(kv_cache_memory=BUDGET, speculative_config={
            "method": "draft_model", "num_speculative_tokens": 2})
    engine = llm.engine
    target = cache_bytes(engine.cache)
    draft = cache_bytes(engine.speculator.drafter.runner.cache)
    assert target + draft <= parse_memory(BUDGET)
    per_block = engine.cache.spec.bytes_per_block
    assert draft == target  # same model: the budget is split in half
    assert engine.cache.num_blocks == parse_memory(BUDGET) // (2 * per_block)
    assert any("KV cache memory" in r.message and "split" in r.message and "draft" in r.message
               for r in caplog.records), [r.message for r in caplog.records]


def test_ngram_drafts_leave_the_whole_budget_to_the_target(make_engine_llm):
    llm = make_engine_llm(kv_cache_memory=BUDGET, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    spec = llm.engine.cache.spec
    assert llm.engine.cache.num_blocks == parse_memory(BUDGET) // spec.bytes_per_block
