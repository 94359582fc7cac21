"""`deepinfer serve` flags for request caps and admin access, turned into `RequestLimits`.

Bad values raise ValueError with a one-line message (the CLI's exit 2)."""
from __future__ import annotations

import argparse

from deepinfer.arg_groups import group
from deepinfer.server.request_limits import RequestLimits

_DEFAULTS = RequestLimits()
# flag -> (RequestLimits field, help)
_CAPS = {
    "--max-request-body-bytes": ("max_request_body_bytes",
                                 "refuse bodies larger than this with 413, before parsing"),
    "--max-sequences-per-request": ("max_sequences_per_request",
                                    "most prompts x n in one request"),
    "--max-messages": ("max_messages", "most chat messages in one request"),
    "--max-stop-strings": ("max_stop_strings", "most stop strings (and bad words) per request"),
    "--max-logit-bias": ("max_logit_bias", "most logit_bias entries per request"),
}


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    g = group(parser, "security")
    g.add_argument("--enable-admin-api", action="store_true",
                   help="serve /admin/scale and /admin/workers (disaggregated serving), behind "
                        "--admin-api-key, else --api-key; one of them is required")
    g.add_argument("--admin-api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /admin/* (separate from "
                        "--api-key, which then does not open them)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (off by default: it "
                        "tells a client which prefixes other clients sent; see cache_salt)")
    g.add_argument("--metrics-need-api-key", action="store_true",
                   help="put /metrics behind --api-key too (default: open, like /health)")
    g.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="answer 429 (with Retry-After) while this many /v1 and /admin "
                        "requests are in flight (default: no cap)")
    g.add_argument("--max-connections", type=int, default=None,
                   help="answer 503 to new requests while this many HTTP connections are open "
                        "(default: half the process's open-file limit, at most 16384)")
    for flag, (name, text) in _CAPS.items():
        g.add_argument(flag, type=int, default=getattr(_DEFAULTS, name),
                       help=f"{text} (default {getattr(_DEFAULTS, name)})")


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    values = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, _) in _CAPS.items()}
    values["max_concurrent_requests"] = args.max_concurrent_requests
    values["max_connections"] = args.max_connections
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return RequestLimits(**values)
