"""Public trace formats read in their own units: detection from keys/columns, Mooncake, Bailian,
Azure 2023/2024, BurstGPT, generic (inferred block size), gzip, shrinking 16-token blocks, and
one-line errors naming file:line. Small files in tmp_path, no network."""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import pytest

from deepinfer.bench.trace_formats import TraceOptions, infer_block_tokens, read_trace_file
from deepinfer.bench.traces import ShrinkConfig
from deepinfer.bench.workload_args import add_workload_args, workload_config_from_args
from deepinfer.bench.workloads import WorkloadConfig, build_workload
from tests.shared_traces import common_prefix_len

PROFILE = str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
              / "cost_profile_smollm2_bf16_cpu_1thread.json")

# Rows as the public files write them (values shortened; key order and types as published).
MOONCAKE = [  # kvcache-ai/Mooncake FAST25 conversation_trace.jsonl: ms, 512-token blocks
    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": list(range(14))},
    {"timestamp": 0, "input_length": 7322, "output_length": 490,
     "hash_ids": [0] + list(range(14, 28))},
    {"timestamp": 3000, "input_length": 2290, "output_length": 316,
     "hash_ids": [0, 42, 43, 44, 45]},
]
BAILIAN = [  # alibaba-edu/qwen-bailian-usagetraces-anon: seconds (float), 16-token blocks
    {"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 1, "hash_ids": list(range(1000, 1033))},
    {"chat_id": 160, "parent_chat_id": -1, "timestamp": 61.5, "input_length": 40,
     "output_length": 12, "type": "search", "turn": 1, "hash_ids": [2000, 2001, 2002]},
    # turn 2 of chat 159: its first 32 full blocks (512 tokens) are turn 1's
    {"chat_id": 201, "parent_chat_id": 159, "timestamp": 75.25, "input_length": 700,
     "output_length": 88, "type": "text", "turn": 2,
     "hash_ids": list(range(1000, 1032)) + list(range(3000, 3012))},
]
AZURE_2024 = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2024-05-10 00:00:00.009930+00:00,2162,5\n"
              "2024-05-10 00:00:00.017335+00:00,2399,6\n"
              "2024-05-10 00:00:01+00:00,76,15\n")
BURSTGPT = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,472,18,490,Conversation log\n"
            "5,ChatGPT,1087,0,1087,Conversation log\n"  # failed: 0 response tokens
            "5,GPT-4,206,145,351,API log\n"
            "7,ChatGPT,99,402,501,Conversation log\n")


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return str(path)


def test_mooncake_is_ms_with_512_token_blocks_whatever_the_extension(tmp_path):
    trace = read_trace_file(write(tmp_path, "trace.data", jsonl(MOONCAKE)))
    assert (trace.format, trace.time_unit, trace.block_tokens) == ("mooncake", "ms", 512)
    assert [r.timestamp_s for r in trace.rows] == [0.0, 1.5, 3.0]  # the 3 s tick spread
    assert trace.rows[1].hash_ids == tuple([0] + list(range(14, 28)))
    reqs = build_workload(WorkloadConfig(kind=f"trace:{tmp_path / 'trace.data'}")).requests
    assert common_prefix_len(reqs[0].prompt_token_ids, reqs[1].prompt_token_ids) == 512


def test_bailian_is_seconds_with_16_token_blocks_and_shares_them_after_shrinking(tmp_path):
    path = write(tmp_path, "qwen_traceA_blksz_16.jsonl", jsonl(BAILIAN))
    trace = read_trace_file(path)
    assert (trace.format, trace.time_unit, trace.block_tokens) == ("bailian", "s", 16)
    assert [r.timestamp_s for r in trace.rows] == pytest.approx([0.0, 0.386, 14.136])
    full = build_workload(WorkloadConfig(kind=f"trace:{path}")).requests
    first, turn2 = full[0].prompt_token_ids, full[2].prompt_token_ids
    assert (len(first), len(turn2)) == (521, 700)
    assert common_prefix_len(first, turn2) == 32 * 16  # the shared blocks, not a token more
    shrunk = build_workload(WorkloadConfig(kind=f"trace:{path}", shrink=ShrinkConfig(0.25)))
    a, b = shrunk.requests[0].prompt_token_ids, shrunk.requests[2].prompt_token_ids
    assert (len(a), len(b)) == (130, 175)
    assert common_prefix_len(a, b) == 32 * 4  # 16-token blocks became 4-token blocks
    assert "bailian format, timestamps in s, hash_ids over 16-token blocks" in shrunk.description
    assert "hash block 16 -> 4 tokens" in shrunk.description


def test_azure_2024_timestamps_with_zone_and_without_fraction(tmp_path):
    trace = read_trace_file(write(tmp_path, "AzureLLMInferenceTrace_code_1week.csv", AZURE_2024))
    assert (trace.format, trace.time_unit, trace.block_tokens) == ("azure", "date-time", None)
    assert [r.timestamp_s for r in trace.rows] == pytest.approx([0.0, 0.007405, 0.99007], abs=1e-6)
    assert [(r.input_len, r.output_len, r.hash_ids) for r in trace.rows][2] == (76, 15, None)


def test_burstgpt_drops_failed_requests_and_spreads_whole_seconds(tmp_path):
    path = write(tmp_path, "BurstGPT_1.csv", BURSTGPT)
    trace = read_trace_file(path)
    assert (trace.format, trace.time_unit, trace.dropped) == ("burstgpt", "s", 1)
    assert [(r.input_len, r.output_len) for r in trace.rows] == [(472, 18), (206, 145), (99, 402)]
    assert [r.timestamp_s for r in trace.rows] == [0.0, 1.0, 2.0]
    assert "1 failed requests (0 response tokens) dropped" in trace.describe()
    assert len(read_trace_file(path, limit=2).rows) == 2  # the limit counts kept requests


def test_gzip_reads_the_same_rows(tmp_path):
    for name, text in (("b.jsonl", jsonl(BAILIAN)), ("g.csv", BURSTGPT)):
        plain = read_trace_file(write(tmp_path, name, text))
        packed = read_trace_file(write(tmp_path, name + ".gz", text))
        assert packed == plain


def test_generic_names_units_and_inferred_block_size(tmp_path):
    rows = [{"arrival_time": 10.0, "prompt_tokens": 100, "completion_tokens": 7,
             "hash_ids": [1, 2]},
            {"arrival_time": 11.25, "prompt_tokens": 300, "completion_tokens": 9,
             "hash_ids": [1, 2, 3, 4, 5]},
            {"arrival_time": 12.0, "prompt_tokens": 64, "completion_tokens": 1, "hash_ids": [1]}]
    trace = read_trace_file(write(tmp_path, "g.jsonl", jsonl(rows)))
    assert (trace.format, trace.time_unit, trace.block_tokens) == ("generic", "s", 64)
    assert [r.timestamp_s for r in trace.rows] == [0.0, 1.25, 2.0]
    w = build_workload(WorkloadConfig(kind=f"trace:{tmp_path / 'g.jsonl'}"))
    assert common_prefix_len(w.requests[0].prompt_token_ids, w.requests[1].prompt_token_ids) == 100
    assert "generic format" in w.description and "64-token blocks" in w.description
    by_name = read_trace_file(write(tmp_path, "m.csv", "time_ms,Input Tokens,output_tokens\n"
                                                       "2000,5,6\n3500,7,8\n"))
    assert by_name.time_unit == "ms" and [r.timestamp_s for r in by_name.rows] == [0.0, 1.5]
    epoch = read_trace_file(write(tmp_path, "e.csv", "timestamp,prompt_len,output_len\n"
                                                     "1717000000000,5,6\n1717000000250,7,8\n"))
    assert epoch.time_unit == "ms" and epoch.rows[1].timestamp_s == pytest.approx(0.25)
    dates = read_trace_file(write(tmp_path, "d.csv", "id,created_at,prompt_tokens,"
                                                     "completion_tokens\n"
                                                     "a,2025-01-01T00:00:00Z,5,6\n"
                                                     "b,2025-01-01T00:00:02.5Z,7,8\n"))
    assert dates.time_unit == "date-time" and dates.rows[1].timestamp_s == 2.5


def test_infer_block_tokens():
    assert infer_block_tokens([(1100, (0, 1, 2)), (300, (5,))]) == 512
    assert infer_block_tokens([(40, (1, 2, 3)), (100, tuple(range(7)))]) == 16
    assert "no single size" in infer_block_tokens([(100, (1, 2)), (100, (1, 2, 3, 4, 5))])
    assert "at most one" in infer_block_tokens([(100, (1,)), (7, (2,))])
    assert "from 334 to 499" in infer_block_tokens([(1000, (1, 2, 3))])  # no power of two


def test_generic_hash_ids_that_fit_no_block_size_need_the_flag(tmp_path):
    rows = [{"timestamp": 0, "input_tokens": 100, "output_tokens": 1, "hash_ids": [1, 2]},
            {"timestamp": 1, "input_tokens": 100, "output_tokens": 1, "hash_ids": [1, 2, 3, 4, 5]}]
    path = write(tmp_path, "g.jsonl", jsonl(rows))
    with pytest.raises(ValueError, match="g.jsonl: cannot infer the hash_ids block size .*"
                                         "--trace-block-tokens"):
        read_trace_file(path)
    assert read_trace_file(path, options=TraceOptions(block_tokens=32)).block_tokens == 32


def test_mooncake_keys_with_other_units_fail_instead_of_replaying_wrong(tmp_path):
    seconds = write(tmp_path, "s.jsonl", jsonl([dict(MOONCAKE[0], timestamp=0.0),
                                                dict(MOONCAKE[2], timestamp=61.114)]))
    with pytest.raises(ValueError, match=r"s.jsonl:2: Mooncake timestamps are whole "
                                         r"milliseconds.*--trace-time-unit s"):
        read_trace_file(seconds)
    trace = read_trace_file(seconds, options=TraceOptions(time_unit="s"))
    assert trace.rows[1].timestamp_s == pytest.approx(61.114)
    small_blocks = write(tmp_path, "b.jsonl", jsonl([
        {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 100, "output_length": 3, "hash_ids": list(range(7))}]))
    with pytest.raises(ValueError, match="fit 16-token blocks.*--trace-block-tokens 16"):
        read_trace_file(small_blocks)
    assert read_trace_file(small_blocks, options=TraceOptions(block_tokens=16)).block_tokens == 16


def test_errors_name_the_columns_or_the_line(tmp_path):
    unknown = write(tmp_path, "u.csv", "user,prompt\nalice,hi\n")
    with pytest.raises(ValueError) as e:
        read_trace_file(unknown)
    message = str(e.value)
    assert "u.csv:2: unknown trace layout, found user, prompt; need" in message
    assert "TIMESTAMP, ContextTokens, GeneratedTokens" in message and "\n" not in message
    bad_csv = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                       "2023-11-16 18:15:46.6805900,374,44\n"
                                       "2023-11-16 18:15:47.1,abc,3\n")
    with pytest.raises(ValueError, match=r"a.csv:3: bad ContextTokens 'abc'"):
        read_trace_file(bad_csv)
    bad_time = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n")
    with pytest.raises(ValueError, match=r"t.csv:2: bad timestamp 'yesterday'"):
        read_trace_file(bad_time)
    bad_json = write(tmp_path, "j.jsonl", jsonl(BAILIAN[:1]) + '{"chat_id": 1,\n')
    with pytest.raises(ValueError, match=r"j.jsonl:2: not a JSON object"):
        read_trace_file(bad_json)
    negative = write(tmp_path, "n.jsonl", jsonl([BAILIAN[0], dict(BAILIAN[1], input_length=-5)]))
    with pytest.raises(ValueError, match=r"n.jsonl:2: bad input_length -5"):
        read_trace_file(negative)
    azure = write(tmp_path, "z.csv", AZURE_2024)
    with pytest.raises(ValueError, match="z.csv:2: not a bailian trace: missing timestamp"):
        read_trace_file(azure, options=TraceOptions(format="bailian"))
    with pytest.raises(ValueError, match="--trace-time-unit applies to numeric"):
        read_trace_file(azure, options=TraceOptions(time_unit="ms"))
    with pytest.raises(ValueError, match="no hash_ids; --trace-block-tokens does not apply"):
        read_trace_file(azure, options=TraceOptions(block_tokens=16))
    with pytest.raises(ValueError, match="is empty"):
        read_trace_file(write(tmp_path, "empty.jsonl", "\n"))
    with pytest.raises(ValueError, match="not a readable text trace"):
        read_trace_file(_truncated_gzip(tmp_path))


def _truncated_gzip(tmp_path) -> str:
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl(BAILIAN).encode())[:40])
    return str(path)


def test_shrink_describes_blocks_rounded_away_from_the_length_scale():
    assert "hash block 16 -> 1 tokens, x0.0625 not x0.01: prefix sharing overstated" in \
        ShrinkConfig(0.01).describe(16)
    assert "overstated" not in ShrinkConfig(0.05).describe(512)  # 25.6 -> 26 tokens


def test_trace_flags_reach_the_workload_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    path = write(tmp_path, "b.jsonl", jsonl(BAILIAN))
    cfg = workload_config_from_args(parser.parse_args(
        ["--workload", f"trace:{path}", "--trace-format", "bailian", "--trace-time-unit", "ms",
         "--trace-block-tokens", "8"]))
    assert (cfg.trace_format, cfg.trace_time_unit, cfg.trace_block_tokens) == ("bailian", "ms", 8)
    description = build_workload(cfg).description
    assert "timestamps in ms, hash_ids over 8-token blocks" in description
    assert "over 0.0 s" in description  # 14.136 read as ms
    with pytest.raises(SystemExit):
        parser.parse_args(["--trace-format", "sharegpt"])
    with pytest.raises(ValueError, match="block tokens must be at least 1"):
        WorkloadConfig(trace_block_tokens=0)


def test_simulator_replays_bailian_and_the_cli_names_a_bad_layout(tmp_path, capsys):
    from deepinfer.cli.main import main
    from deepinfer.sim import cluster_from_dict, simulate_workload

    path = write(tmp_path, "b.jsonl", jsonl(BAILIAN))
    workload = build_workload(WorkloadConfig(kind=f"trace:{path}", shrink=ShrinkConfig(0.25),
                                             time_scale=0.1))
    cluster = cluster_from_dict({"cost": {"profile": PROFILE}, "engine": {"num_kv_blocks": 256},
                                 "pools": {"colocated": {"workers": 1}}})
    assert simulate_workload(cluster, workload).summary().num_completed == 3
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps({"cost": {"profile": PROFILE},
                                        "engine": {"num_kv_blocks": 256},
                                        "pools": {"colocated": {"workers": 1}}}))
    burst = write(tmp_path, "burst.csv.gz", BURSTGPT)
    assert main(["simulate", "--cluster", str(cluster_file), "--workload", f"trace:{burst}"]) == 0
    assert "burstgpt format, timestamps in s" in capsys.readouterr().out
    unknown = write(tmp_path, "u.csv", "user,prompt\nalice,hi\n")
    assert main(["simulate", "--cluster", str(cluster_file), "--workload",
                 f"trace:{unknown}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deepinfer simulate: error:") and "unknown trace layout" in err
    assert "\n" not in err


def test_a_later_window_skips_kept_requests_and_restarts_the_clock(tmp_path):
    path = write(tmp_path, "BurstGPT_1.csv", BURSTGPT)
    full = read_trace_file(path).rows
    window = read_trace_file(path, limit=1, start=1).rows
    assert [(r.input_len, r.output_len) for r in window] == [(full[1].input_len,
                                                             full[1].output_len)]
    assert window[0].timestamp_s == 0.0  # times count from the window's first request
    assert read_trace_file(path, start=10).rows == []
    with pytest.raises(ValueError, match="trace start"):
        read_trace_file(path, start=-1)
    from deepinfer.bench.workloads import WorkloadConfig, build_workload
    with pytest.raises(ValueError, match="trace_start"):
        WorkloadConfig(kind=f"trace:{path}", trace_start=-2)
    later = build_workload(WorkloadConfig(kind=f"trace:{path}", num_prompts=2, trace_start=1))
    assert "from request 1" in later.description
    assert len(later.requests) == 2
