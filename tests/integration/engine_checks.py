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
    """`llm.generate` followed by the idle/invariant checks (after every generate)."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == len(prompts)
    assert_engine_idle(llm)
    return outputs


def chat_checked(llm, conversations, params):
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert_engine_idle(llm)
    return outputs


def run_handoff(prefill, base, prompt: list[int], params, max_steps: int = 100,
                **decode_config):
    """In process, as the disaggregated workers do it: the `prefill` engine samples the first
    token, its prompt KV is copied into a `DisaggDecodeEngine` (sharing `base`'s model, with
    `decode_config` for its EngineConfig), which continues at output position 1.
    Returns (the decode side's final RequestOutput output, the decode engine)."""
    import time

    from deepinfer.cluster.decode_engine import DisaggDecodeEngine
    from deepinfer.engine.engine_config import EngineConfig

    prefill.add_request("h", prompt, params)
    first: list[int] = []
    while not first:
        for out in prefill.step():
            first = list(out.outputs[0].token_ids)
    assert len(first) == 1
    kv = prefill.cache.read_blocks(prefill.scheduler.kv.block_ids("h"))
    prefill.abort_request(["h"])
    decode = DisaggDecodeEngine(
        EngineConfig(model=None, dtype="float32", kv_cache_memory="64MiB", **decode_config),
        source=base.source, model=base.model, tokenizer=base.tokenizer)
    block_ids = decode.add_transferred_request("h", prompt, params, time.monotonic(), first[0],
                                               None)
    decode.cache.write_blocks(block_ids, kv)
    decode.admit_transferred("h")
    for _ in range(max_steps):
        for out in decode.step():
            if out.finished:
                return out.outputs[0], decode
    raise AssertionError("the decode engine did not finish the request")

