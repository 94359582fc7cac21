"""`deepinfer serve` request-cap and admin flags: parsed into RequestLimits and ServerConfig
fields, defaults equal to RequestLimits', nonsense refused with a one-line error."""
from __future__ import annotations

import pytest

from deepinfer.cli.main import build_parser
from deepinfer.server.limit_args import limits_from_args
from deepinfer.server.request_limits import RequestLimits


def serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_are_the_request_limits_defaults():
    args = serve_args()
    assert limits_from_args(args) == RequestLimits()
    assert args.admin_api_key is None and not args.metrics_need_api_key


def test_flags_reach_the_limits():
    args = serve_args("--max-request-body-bytes", "1000", "--max-concurrent-requests", "7",
                      "--max-sequences-per-request", "16", "--max-messages", "5",
                      "--max-stop-strings", "3", "--max-logit-bias", "9",
                      "--admin-api-key", "adm")
    limits = limits_from_args(args)
    assert (limits.max_request_body_bytes, limits.max_concurrent_requests,
            limits.max_sequences_per_request, limits.max_messages, limits.max_stop_strings,
            limits.max_logit_bias) == (1000, 7, 16, 5, 3, 9)
    assert args.admin_api_key == "adm"


@pytest.mark.parametrize("flag", ["--max-request-body-bytes", "--max-concurrent-requests",
                                  "--max-stop-strings"])
def test_nonsense_is_refused(flag):
    with pytest.raises(ValueError, match=flag):
        limits_from_args(serve_args(flag, "0"))
