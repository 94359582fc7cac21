"""Shared session fixtures. Each owner keeps a clearly named section."""
from __future__ import annotations

import os

import pytest

# Many engines are built and dropped per session: frozen startup objects would never be freed.
os.environ.setdefault("DEEPINFER_GC_FREEZE", "0")

# ---------------------------------------------------------------------------------------------
# Engine reference tests (tests/integration/test_engine_reference.py, test_sampling.py,
# test_cli.py): ONE Hugging Face reference model and ONE fp32 engine per session; other engine
# configurations reuse the base engine's weights via `share_weights_with=`.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def hf_reference():
    """`HFReference`: transformers fp32 on the embedded GGUF, greedy traces memoised."""
    from tests.integration.hf_reference import HFReference, default_gguf_path
    return HFReference(default_gguf_path())


@pytest.fixture(scope="session")
def engine_base_llm():
    """The default model in fp32 with prefix caching on (the engine's defaults otherwise)."""
    from deepinfer import LLM
    return LLM(model=None, dtype="float32", kv_cache_memory="1GiB", seed=0)


@pytest.fixture(scope="session")
def make_engine_llm(engine_base_llm):
    """Factory: `make_engine_llm(**LLM kwargs)` -> an LLM on the base engine's weights."""
    from deepinfer import LLM

    def make(**kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("seed", 0)
        if "num_kv_blocks" not in kwargs:
            kwargs.setdefault("kv_cache_memory", "256MiB")
        return LLM(model=None, share_weights_with=engine_base_llm, **kwargs)

    return make


# ---------------------------------------------------------------------------------------------
# Models and loading (tests/integration/test_gguf_loader.py): the embedded default model,
# resolved once and loaded once in fp32 per session.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def default_model_source():
    """`ModelSource` of the embedded SmolLM2-135M-Instruct GGUF."""
    from deepinfer.runtime.model_source import resolve_model
    return resolve_model(None)


@pytest.fixture(scope="session")
def default_model_fp32(default_model_source):
    """Our LlamaForCausalLM on the default model, float32 (read-only: do not modify)."""
    import torch

    from deepinfer.runtime.model_source import load_model
    return load_model(default_model_source, torch.float32)


# ---------------------------------------------------------------------------------------------
# API server robustness (tests/integration/test_api_fuzz.py, test_engine_restart.py): ONE small
# real `deepinfer serve` per session (short context, so any valid fuzzed request is cheap). The
# restart test kills its engine, so it runs after the fuzz (file order) and heals it.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def small_server():
    """A started `ServeProcess` (no API key, no waiting limit, --max-model-len 64, cached-token
    counts in the usage)."""
    from tests.integration.serve_process import (SMALL_SERVER_ARGS, SMALL_SERVER_ENV,
                                                 running_server)
    with running_server(*SMALL_SERVER_ARGS, env=SMALL_SERVER_ENV) as server:
        yield server


# ---------------------------------------------------------------------------------------------
# Vision-language (tests/integration/test_llava*.py): tiny random LLaVA checkpoints (CLIP and
# SigLIP towers, see tests/integration/llava_checkpoints.py), written once per session.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def llava_checkpoints(tmp_path_factory, default_model_source):
    """{kind: checkpoint directory} for every LLAVA_KINDS entry."""
    import copy

    from tests.integration.llava_checkpoints import llava_dirs
    tokenizer = default_model_source.load_tokenizer()
    return llava_dirs(str(tmp_path_factory.mktemp("llava")), lambda: copy.deepcopy(tokenizer))


# ---------------------------------------------------------------------------------------------
# Quality measurements (tests/integration/test_prompt_logprobs.py, test_perplexity.py): the
# default model as `deepinfer serve` runs it by default (bfloat16), once per session.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def default_bf16_llm():
    from deepinfer import LLM
    return LLM(model=None, dtype="bfloat16", kv_cache_memory="256MiB", seed=0)
