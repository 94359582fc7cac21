"""Where the public request traces live (`shared/traces` beside the checkout), for tests.

CI always lays `shared/` beside the clone, so a missing trace there is a failure, not a
skip; on a developer's machine without it the trace tests are reported as skipped.
"""
from __future__ import annotations

import os

import pytest

TRACES_DIR = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                           "traces"))


def trace_path(*parts: str) -> str:
    """The path of a shared trace file; fails under CI and skips elsewhere when it is absent."""
    path = os.path.join(TRACES_DIR, *parts)
    if not os.path.exists(path):
        message = f"shared trace missing: {path}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading token ids two prompts share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
