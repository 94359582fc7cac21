"""Public LLM-serving trace formats: detect a file's format from its own keys/columns (not its
extension), read its rows in stated units, and fail with one clear line on anything else.

    format    layout  time                      lengths                          hash_ids blocks
    mooncake  JSONL   timestamp, ms             input_length, output_length      512 tokens
    bailian   JSONL   timestamp, s (float)      input_length, output_length      16 tokens
    azure     CSV     TIMESTAMP, a date-time    ContextTokens, GeneratedTokens   none
    burstgpt  CSV     Timestamp, s from day 0   Request tokens, Response tokens  none
    generic   either  timestamp|arrival_time..  input_length|prompt_tokens..,    optional,
                                                output_length|completion_tokens..  inferred

Any of them may be gzip-compressed (detected from the bytes, so `.gz` or not). Sources checked:

- Mooncake (kvcache-ai/Mooncake FAST25-release/traces: conversation, toolagent, synthetic; and
  the older arXiv `mooncake_trace.jsonl`, same keys): `timestamp` in ms, one `hash_ids` entry per
  512-token block, ids chained (a shared id implies the whole prefix before it is shared).
  Timestamps are whole milliseconds, so a fractional one (a seconds trace under Mooncake's keys)
  is an error asking for --trace-time-unit rather than a replay 1000x too fast.
- Bailian (alibaba-edu/qwen-bailian-usagetraces-anon README; ai-dynamo/aiperf docs,
  tutorials/bailian-trace.md): `chat_id`, `parent_chat_id` (-1 for a root), `timestamp` in
  seconds from the trace's start (float), `input_length`, `output_length`, `type`
  (text/search/image/file), `turn`, `hash_ids` of salted SipHash-2-4 over 16-token blocks. The
  hashes are per block, not chained (Hugging Face maxbromberg/flux-traces, discussion 1): a block
  repeated under another prefix keeps its id. Replayed here it gets the same tokens, and the
  engine's chained prefix hash then does not hit on it - as a real prefix cache would not. The
  units are overridable (--trace-time-unit, --trace-block-tokens).
- Azure LLM inference 2023 (Splitwise; AzureLLMInferenceTrace_{conv,code}.csv) and 2024
  (DynamoLLM; AzureLLMInferenceTrace_{conv,code}_1week.csv), Azure/AzurePublicDataset
  AzureLLMInferenceDataset2023.md / 2024.md: `TIMESTAMP,ContextTokens,GeneratedTokens`;
  timestamps '2023-11-16 18:15:46.6805900' (2023) or '2024-05-10 00:00:00.009930+00:00' and
  '2024-05-12 00:00:00+00:00' (2024). A time without a zone is read as UTC.
- BurstGPT (HPMLL/BurstGPT README, schema): `Timestamp` (s from 0:00:00 on the first day),
  `Model`, `Request tokens`, `Response tokens`, `Total tokens`, `Log Type`. Rows whose `Response
  tokens` is 0 are failed requests (the authors also publish `*_without_fails_*.csv` without
  them); they are dropped, since a failed request says nothing about the output it would have
  made, and the description says how many.
- generic: a time column and input/output length columns under common names (`_names` below);
  numeric times are seconds unless the column says `_ms`, the values are Unix epoch
  milliseconds (>= 1e11), or --trace-time-unit says otherwise; ISO date-times are parsed. Its
  `hash_ids` block size is inferred: the one b with len(hash_ids) == ceil(input_length / b) on
  every row, else --trace-block-tokens is required.

Requests sharing a timestamp are spread evenly over the gap to the next one (Mooncake's ~3 s
ticks, BurstGPT's whole seconds). Pure: stdlib + numpy (through traces.py).
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import io
import itertools
import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterator

from deepinfer.bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRow, spread_ticks

FORMATS = ("mooncake", "bailian", "azure", "burstgpt", "generic")
TIME_UNITS = {"s": 1.0, "ms": 1000.0}  # divisor to seconds
BAILIAN_BLOCK_TOKENS = 16
EPOCH_MS_THRESHOLD = 1e11  # larger numeric times are Unix epoch milliseconds (1e11 s = year 5138)

# Generic column names, most specific first; compared after lower-casing and mapping ' '/'-' to '_'.
_TIME_NAMES = ("timestamp", "timestamp_ms", "timestamp_s", "arrival_time", "arrival_time_ms",
               "arrival_time_s", "arrival_timestamp", "time", "time_ms", "time_s", "ts",
               "request_time", "start_time", "created_at")
_INPUT_NAMES = ("input_length", "input_len", "input_tokens", "num_input_tokens", "prompt_length",
                "prompt_len", "prompt_tokens", "num_prompt_tokens", "context_tokens",
                "context_length", "request_tokens", "isl")
_OUTPUT_NAMES = ("output_length", "output_len", "output_tokens", "num_output_tokens",
                 "completion_tokens", "completion_length", "completion_len", "generated_tokens",
                 "response_tokens", "response_length", "osl")
_HASH_NAMES = ("hash_ids",)


@dataclass(frozen=True)
class TraceOptions:
    """What the user said about the trace; None / 'auto': the detected format's own units."""

    format: str = "auto"
    time_unit: str | None = None  # s | ms, for numeric timestamps
    block_tokens: int | None = None  # tokens per hash_ids entry

    def __post_init__(self) -> None:
        if self.format != "auto" and self.format not in FORMATS:
            raise ValueError(f"unknown trace format {self.format!r}: use auto, "
                             + ", ".join(FORMATS))
        if self.time_unit is not None and self.time_unit not in TIME_UNITS:
            raise ValueError(f"trace time unit must be s or ms, got {self.time_unit!r}")
        if self.block_tokens is not None and self.block_tokens < 1:
            raise ValueError("trace block tokens must be at least 1")


@dataclass(frozen=True)
class Trace:
    """The rows read, and how they were read (so a wrong guess shows in the report)."""

    rows: list[TraceRow]
    format: str
    time_unit: str  # s | ms | date-time
    block_tokens: int | None  # None: no prefix information
    dropped: int = 0  # failed requests left out (BurstGPT)

    def describe(self) -> str:
        blocks = (f"hash_ids over {self.block_tokens}-token blocks" if self.block_tokens
                  else "no prefix information")
        times = ("date-time timestamps" if self.time_unit == "date-time"
                 else f"timestamps in {self.time_unit}")
        text = f"{self.format} format, {times}, {blocks}"
        if self.dropped:
            text += f", {self.dropped} failed requests (0 response tokens) dropped"
        return text


@dataclass(frozen=True)
class _Columns:
    """Where one format keeps its fields, and their units."""

    time: str
    input: str
    output: str
    hash_ids: str | None
    time_unit: str | None  # None: a date-time, or decided from the values (generic)
    block_tokens: int | None  # None: none, or inferred (generic)


_KNOWN = {
    "mooncake": _Columns("timestamp", "input_length", "output_length", "hash_ids", "ms",
                         MOONCAKE_BLOCK_TOKENS),
    "bailian": _Columns("timestamp", "input_length", "output_length", "hash_ids", "s",
                        BAILIAN_BLOCK_TOKENS),
    "azure": _Columns("TIMESTAMP", "ContextTokens", "GeneratedTokens", None, None, None),
    "burstgpt": _Columns("Timestamp", "Request tokens", "Response tokens", None, "s", None),
}
_BAILIAN_MARKS = ("chat_id", "parent_chat_id", "turn")
_NEEDS = ("mooncake (timestamp, input_length, output_length, hash_ids), bailian (the same + "
          "chat_id, parent_chat_id, turn), azure (TIMESTAMP, ContextTokens, GeneratedTokens), "
          "burstgpt (Timestamp, Request tokens, Response tokens), or generic: a time column ("
          + "|".join(_TIME_NAMES[:8]) + "...), an input length (" + "|".join(_INPUT_NAMES[:8])
          + "...) and an output length (" + "|".join(_OUTPUT_NAMES[:6]) + "...)")


def read_trace_file(path: str, limit: int | None = None,
                    options: TraceOptions = TraceOptions(), start: int = 0) -> Trace:
    """`limit` requests of the trace at `path` (all when None) from its `start`-th kept one
    (0: the first), times in seconds from the earliest of them. Raises ValueError naming the
    file (and line) for anything it cannot read."""
    if start < 0:
        raise ValueError(f"trace start must be >= 0, got {start}")
    records = _records(path)
    try:
        first = next(records, None)
        if first is None:
            raise ValueError(f"trace {path!r} is empty")
        name, cols = _layout(f"{path}:{first[0]}", list(first[1]), options.format)
        numeric_unit = _time_unit(path, name, cols, first[1], options)
        whole_ms = name == "mooncake" and options.time_unit is None
        raw, dropped, skipped = [], 0, 0
        for line_no, rec in itertools.chain([first], records):
            if limit is not None and len(raw) >= limit:
                break
            row = _parse(path, line_no, rec, cols, numeric_unit)
            if whole_ms and not _number(rec[cols.time]).is_integer():
                raise ValueError(
                    f"{path}:{line_no}: Mooncake timestamps are whole milliseconds, this one is "
                    f"{rec[cols.time]!r}: if the trace counts seconds pass --trace-time-unit s "
                    "(--trace-time-unit ms keeps milliseconds)")
            if name == "burstgpt" and row[2] == 0:
                dropped += 1
                continue
            if skipped < start:  # a held-out window: later requests of the same trace
                skipped += 1
                continue
            raw.append(row)
    finally:
        records.close()
    block_tokens = _block_tokens(path, name, cols, raw, options)
    times = spread_ticks([r[0] for r in raw])
    rows = [TraceRow(t, i, o, h) for t, (_, i, o, h) in zip(times, raw)]
    return Trace(rows, name, numeric_unit or "date-time", block_tokens, dropped)


def read_mooncake_jsonl(path: str, limit: int | None = None) -> list[TraceRow]:
    return read_trace_file(path, limit, TraceOptions(format="mooncake")).rows


def read_azure_csv(path: str, limit: int | None = None) -> list[TraceRow]:
    return read_trace_file(path, limit, TraceOptions(format="azure")).rows


def _open_text(path: str) -> io.TextIOBase:
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if gzipped:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _records(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a JSONL (a line starting with '{') or headed CSV file."""
    try:
        with _open_text(path) as f:
            head = ""
            for head in f:
                if head.strip():
                    break
        with _open_text(path) as f:
            if head.lstrip().startswith("{"):
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except ValueError as e:
                        raise ValueError(f"{path}:{line_no}: not a JSON object ({e})") from None
                    if not isinstance(rec, dict):
                        raise ValueError(f"{path}:{line_no}: not a JSON object")
                    yield line_no, rec
            else:
                reader = csv.DictReader(f)
                for rec in reader:
                    if None in rec:
                        raise ValueError(f"{path}:{reader.line_num}: more fields than the "
                                         f"header's {len(reader.fieldnames)}")
                    yield reader.line_num, rec
    except (UnicodeDecodeError, EOFError, csv.Error, gzip.BadGzipFile) as e:
        raise ValueError(f"{path}: not a readable text trace ({e})") from None


def _norm(key: str) -> str:
    return key.strip().lower().replace(" ", "_").replace("-", "_")


def _generic_columns(keys: list[str]) -> _Columns | None:
    by_norm = {}
    for k in keys:
        by_norm.setdefault(_norm(k), k)

    def pick(names):
        return next((by_norm[n] for n in names if n in by_norm), None)

    time, inp, out = pick(_TIME_NAMES), pick(_INPUT_NAMES), pick(_OUTPUT_NAMES)
    if time is None or inp is None or out is None:
        return None
    unit = "ms" if _norm(time).endswith("_ms") else "s" if _norm(time).endswith("_s") else None
    return _Columns(time, inp, out, pick(_HASH_NAMES), unit, None)


def _layout(where: str, keys: list[str], wanted: str) -> tuple[str, _Columns]:
    """The format's name and columns: the one asked for, else the first that fits `keys` (those
    of the first record, at `where`)."""
    present = set(keys)
    if wanted == "auto":
        if set(_fields(_KNOWN["bailian"])) <= present and present & set(_BAILIAN_MARKS):
            return "bailian", _KNOWN["bailian"]
        for name in ("mooncake", "azure", "burstgpt"):
            if set(_fields(_KNOWN[name])) <= present:
                return name, _KNOWN[name]
        cols = _generic_columns(keys)
        if cols is None:
            raise ValueError(f"{where}: unknown trace layout, found {_show(keys)}; need "
                             + _NEEDS)
        return "generic", cols
    if wanted == "generic":
        cols = _generic_columns(keys)
        if cols is None:
            raise ValueError(f"{where}: not a generic trace, found {_show(keys)}; need "
                             + _NEEDS)
        return wanted, cols
    cols = _KNOWN[wanted]
    missing = [f for f in _fields(cols) if f not in present]
    if missing:
        raise ValueError(f"{where}: not a {wanted} trace: missing {_show(missing)} "
                         f"(found {_show(keys)})")
    return wanted, cols


def _fields(cols: _Columns) -> list[str]:
    return [f for f in (cols.time, cols.input, cols.output, cols.hash_ids) if f is not None]


def _show(keys: list[str]) -> str:
    return ", ".join(keys[:12]) + (f" (+{len(keys) - 12} more)" if len(keys) > 12 else "")


def _time_unit(path: str, name: str, cols: _Columns, first: dict,
               options: TraceOptions) -> str | None:
    """The unit of numeric timestamps; None when the file holds date-times."""
    value = first.get(cols.time)
    is_datetime = name == "azure" or (name == "generic" and isinstance(value, str)
                                      and _number(value) is None)
    if is_datetime:
        if options.time_unit is not None:
            raise ValueError(f"{path}: timestamps are date-times ({value!r}); "
                             "--trace-time-unit applies to numeric ones only")
        return None
    if options.time_unit is not None:
        return options.time_unit
    if cols.time_unit is not None:
        return cols.time_unit
    number = _number(value)  # generic, unit not in the column's name
    return "ms" if number is not None and number >= EPOCH_MS_THRESHOLD else "s"


def _number(value) -> float | None:
    """A JSON number or a CSV cell holding one, else None."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _parse(path: str, line_no: int, rec: dict, cols: _Columns,
           numeric_unit: str | None) -> tuple[float, int, int, tuple[int, ...] | None]:
    where = f"{path}:{line_no}"
    for f in _fields(cols):
        if f not in rec:
            raise ValueError(f"{where}: missing {f!r}")
    value = rec[cols.time]
    if numeric_unit is None:
        t = _datetime_seconds(where, value)
    else:
        number = _number(value)
        if number is None or not math.isfinite(number):
            raise ValueError(f"{where}: bad {cols.time} {value!r} (need a number)")
        t = number / TIME_UNITS[numeric_unit]
    hash_ids = None if cols.hash_ids is None else _hash_ids(where, rec[cols.hash_ids])
    return t, _count(where, cols.input, rec[cols.input]), \
        _count(where, cols.output, rec[cols.output]), hash_ids


def _datetime_seconds(where: str, value) -> float:
    """'2023-11-16 18:15:46.6805900' or '2024-05-10 00:00:00.009930+00:00' -> POSIX seconds."""
    try:
        stamp = datetime.fromisoformat(str(value).strip())
    except ValueError:
        raise ValueError(f"{where}: bad timestamp {value!r} (need a date-time)") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def _count(where: str, name: str, value) -> int:
    number = _number(value)
    if number is None or not math.isfinite(number) or number < 0 or not number.is_integer():
        raise ValueError(f"{where}: bad {name} {value!r} (need a token count >= 0)")
    return int(number)


def _hash_ids(where: str, value) -> tuple[int, ...]:
    """A list of ids (a CSV cell: "[1, 2, 3]" or "1 2 3"). Ids that are not non-negative
    integers (hex digests, negative numbers) map to one stable integer each."""
    parts = value.strip().strip("[]").replace(",", " ").split() if isinstance(value, str) \
        else value
    if not isinstance(parts, list):
        raise ValueError(f"{where}: bad hash_ids {value!r} (need a list of ids)")
    ids = []
    for p in parts:
        if isinstance(p, str) and p.isdigit():
            p = int(p)
        if isinstance(p, int) and not isinstance(p, bool) and p >= 0:
            ids.append(p)
        elif isinstance(p, (str, int)) and not isinstance(p, bool):
            digest = hashlib.blake2b(str(p).encode(), digest_size=8).digest()
            ids.append(int.from_bytes(digest, "little") | 1 << 64)  # clear of plain ids < 2**64
        else:
            raise ValueError(f"{where}: bad hash_ids {value!r} (need a list of ids)")
    return tuple(ids)


def _block_tokens(path: str, name: str, cols: _Columns, raw: list,
                  options: TraceOptions) -> int | None:
    """Tokens per hash_ids entry: the user's, else the format's (checked against the rows), else
    (generic) inferred from the rows."""
    if cols.hash_ids is None:
        if options.block_tokens is not None:
            raise ValueError(f"{path}: this {name} trace has no hash_ids; "
                             "--trace-block-tokens does not apply")
        return None
    if options.block_tokens is not None:
        return options.block_tokens
    rows = [(r[1], r[3]) for r in raw]
    if not rows:
        return cols.block_tokens
    if cols.block_tokens is not None:
        inferred = infer_block_tokens(rows)
        if isinstance(inferred, int) and inferred != cols.block_tokens:
            raise ValueError(f"{path}: hash_ids fit {inferred}-token blocks on every row, not "
                             f"{name}'s {cols.block_tokens}: pass --trace-block-tokens {inferred} "
                             f"(or --trace-block-tokens {cols.block_tokens} to keep it)")
        return cols.block_tokens
    inferred = infer_block_tokens(rows)
    if not isinstance(inferred, int):
        raise ValueError(f"{path}: cannot infer the hash_ids block size ({inferred}): "
                         "pass --trace-block-tokens N")
    return inferred


def infer_block_tokens(rows: list[tuple[int, tuple[int, ...]]]) -> int | str:
    """The block size b with len(hash_ids) == ceil(input_len / b) on every (input_len, hash_ids)
    row, preferring the one power of two among several; else a reason (str) why there is none."""
    low, high = 1, None  # integer b in [low, high]
    for n, ids in rows:
        k = len(ids)
        if k == 0 or n == 0:
            if k != n:
                return f"a row with {n} input tokens has {k} hash ids"
            continue
        low = max(low, -(-n // k))  # ceil(n / k) <= b
        if k > 1:  # b < n / (k - 1)
            bound = -(-n // (k - 1)) - 1
            high = bound if high is None else min(high, bound)
        if high is not None and low > high:
            return f"no single size fits (a row with {n} input tokens has {k} hash ids)"
    if high is None:
        return f"any size >= {low} fits (every row has at most one hash id)"
    if low == high:
        return low
    powers = [1 << p for p in range(low.bit_length() - 1, high.bit_length())
              if low <= 1 << p <= high]
    if len(powers) == 1:
        return powers[0]
    return f"any size from {low} to {high} fits"
