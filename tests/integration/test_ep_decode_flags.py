"""`serve` flags of EP decode groups: bad combinations are one-line CLI errors (exit 2) before
any process starts."""
from __future__ import annotations

import pytest

from deepinfer.cli.main import main

DISAGG = ["--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "none"]


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel-size", "2"], "--decode-data-parallel-size"),
    (["--ep-groups", "2"], "--decode-data-parallel-size"),
    (["--decode-data-parallel-size", "2", "--enable-expert-parallel"], "needs a MoE model"),
    (["--decode-data-parallel-size", "0"], "--decode-data-parallel-size must be >= 1"),
])
def test_decode_group_flag_errors_exit_2_with_one_line(flags, message, capsys):
    assert main(["serve", "--port", "1", *DISAGG, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
