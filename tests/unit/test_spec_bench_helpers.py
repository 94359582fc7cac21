"""The timing loop and counters both speculative-decoding benchmarks share
(benchmarks/spec_decode_bench.py, used by spec_vs_vllm.py)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from spec_decode_bench import acceptance, alternate  # noqa: E402


def test_alternate_takes_turns_batch_by_batch_and_keeps_each_engines_results():
    calls = []

    def engine(name):
        def run(start, stop):
            calls.append((name, start, stop))
            return [f"{name}{i}" for i in range(start, stop)]
        return run

    seen = []
    out = alternate({"a": engine("a"), "b": engine("b")}, 5, 2,
                    lambda start, results: seen.append((start, len(results["b"]))))
    assert calls == [("a", 0, 2), ("b", 0, 2), ("a", 2, 4), ("b", 2, 4), ("a", 4, 5), ("b", 4, 5)]
    assert out == {"a": ["a0", "a1", "a2", "a3", "a4"], "b": ["b0", "b1", "b2", "b3", "b4"]}
    assert seen == [(0, 2), (2, 4), (4, 5)]


def test_acceptance_between_counter_snapshots():
    before = {"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 10,
              "spec_decode_num_accepted_tokens": 5}
    after = {"spec_decode_num_drafts": 6, "spec_decode_num_draft_tokens": 30,
             "spec_decode_num_accepted_tokens": 17}
    got = acceptance(before, after)
    assert (got["num_drafts"], got["num_draft_tokens"], got["num_accepted_tokens"]) == (4, 20, 12)
    assert got["mean_acceptance_length"] == 4.0 and got["acceptance_rate"] == 0.6
    assert acceptance({}, {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                           "spec_decode_num_accepted_tokens": 0})["mean_acceptance_length"] is None
    assert acceptance({}, {}) == {}  # an engine without the counters (plain, old vLLM)
