"""Benchmark-only: frames without their HMAC, to measure what authentication costs.

`benchmarks/auth_cost_bench.py` puts this folder on PYTHONPATH for the server it starts with
authentication "off"; every process the server starts inherits it. Python imports
`sitecustomize` at start-up, before any DeepInfer module, and this replaces the one MAC
function that signing and verifying both call with a constant: the frames keep their layout,
sequence checks and size checks, and skip only the SHA-256 passes. Never on a product path.
"""
import os

if os.environ.get("DEEPINFER_BENCH_AUTH_OFF") == "1":
    from deepinfer.wire import frame as _frame

    _NO_MAC = bytes(_frame.MAC_BYTES)

    def _no_mac(key, head, channel, payload, attached):
        return _NO_MAC

    _frame._mac = _no_mac
