"""Speculative decoding at the serving edges: the --speculative-config flag and the
`deepinfer:spec_decode_*` Prometheus counters (kept across engine restarts)."""
from __future__ import annotations

import pytest

from deepinfer.cli.main import main
from deepinfer.clients.colocated import _add_counters
from deepinfer.wire.engine_messages import EngineStatsSnapshot
from deepinfer.server.metrics import ServerMetrics


@pytest.mark.parametrize("value, message", [
    ("{bad", "not valid JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "must be one of"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
])
def test_bad_speculative_config_is_a_one_line_cli_error(capsys, value, message):
    assert main(["serve", "--speculative-config", value]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_spec_decode_counters_are_exported_with_vllm_names():
    snapshot = EngineStatsSnapshot(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12,
                                   spec_decode_num_accepted_tokens=7,
                                   spec_decode_num_accepted_tokens_per_pos=[3, 2, 2, 0])
    text = ServerMetrics("m", lambda: snapshot).render().decode()
    assert 'deepinfer:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'deepinfer:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'deepinfer:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert ('deepinfer:spec_decode_num_accepted_tokens_per_pos_total'
            '{model_name="m",position="1"} 2.0') in text


def test_spec_decode_counters_survive_an_engine_restart():
    dead = EngineStatsSnapshot(spec_decode_num_drafts=3, spec_decode_num_accepted_tokens_per_pos=[3, 1])
    now = EngineStatsSnapshot(spec_decode_num_drafts=2, spec_decode_num_accepted_tokens_per_pos=[1, 1, 1])
    total = _add_counters(dead, now)
    assert total.spec_decode_num_drafts == 5
    assert total.spec_decode_num_accepted_tokens_per_pos == [4, 2, 1]
