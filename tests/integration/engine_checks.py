"""Helpers shared by the engine reference, sampling and CLI tests."""
from __future__ import annotations


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    """Token-id prompts in the shape `LLM.generate` accepts."""
    return [{"prompt_token_ids": list(ids)} for ids in prompts]


def assert_engine_idle(llm) -> None:
    """After a `generate` returns: scheduler invariants hold, nothing is left running or
    waiting, and no KV block is held by a request (cached blocks may stay, unreferenced)."""
    llm.engine.scheduler.check_invariants()
    stats = llm.engine.get_stats()
    assert stats.num_running == 0, f"requests still running after generate: {stats}"
    assert stats.num_waiting == 0, f"requests still waiting after generate: {stats}"
    assert stats.num_kv_blocks_used == 0, f"KV blocks leaked after generate: {stats}"


def generate_checked(llm, prompts, params):
    """`llm.generate` followed by the idle/invariant checks (issue 2: after every generate)."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == len(prompts)
    assert_engine_idle(llm)
    return outputs


def chat_checked(llm, conversations, params):
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert_engine_idle(llm)
    return outputs
