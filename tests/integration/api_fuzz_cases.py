"""Seeded malformed and edge-case OpenAI requests, and a bounded runner that fires them at a
server. Shared by tests/integration/test_api_fuzz.py (a few hundred) and
benchmarks/api_fuzz.py (thousands).

Each case starts from a small valid request (max_tokens <= 2, so a case the server accepts
stays cheap) and breaks one thing: a field's type or value (huge, negative, NaN, Infinity),
the prompt's token ids, the chat messages, the strings (unicode, huge), the JSON itself
(invalid, deeply nested, not an object), the content type, or the client (leaves mid-stream).
The server must answer every case below 500, within the client timeout.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "n", "temperature", "top_p", "top_k",
                     "min_p", "seed", "stop", "stream", "stream_options", "logprobs", "echo",
                     "suffix", "best_of", "presence_penalty", "frequency_penalty", "logit_bias",
                     "user", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                     "include_stop_str_in_output", "return_token_ids", "repetition_penalty",
                     "allowed_token_ids", "truncate_prompt_tokens", "add_special_tokens",
                     "prompt_logprobs",
                     # vLLM options the server rejects unless "off"
                     "use_beam_search", "bad_words", "guided_json",
                     "spaces_between_special_tokens", "length_penalty", "priority")
CHAT_FIELDS = tuple(f for f in COMPLETION_FIELDS if f not in ("prompt", "logprobs", "echo",
                                                                "suffix", "best_of")) + (
    "messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
    "tools", "response_format", "tool_choice", "chat_template_kwargs",
    "continue_final_message")

INT64_MAX = 2 ** 63 - 1
NAN, INF = float("nan"), float("inf")
EXTREME_NUMBERS = (0, -1, 1, 2, 20, 21, 128, 129, 1024, 2 ** 31, -2 ** 31, INT64_MAX,
                   INT64_MAX + 1, -INT64_MAX - 2, 2 ** 64, 10 ** 30, -10 ** 30, 1e308, -1e308,
                   5e-324, 1e-300, 0.5, -0.5, 1.0000001, 2.0000001, NAN, INF, -INF)
UNICODE = ("héllo wörld", "日本語のテキスト", "emoji 🦙🔥👩‍👩‍👧", "\u202eRTL override",
           "zero\u200bwidth", "combining e\u0301\u0301\u0301", "nul \u0000 byte", "\uffff\ufffe",
           "tab\tnew\nline\r", "ｆｕｌｌｗｉｄｔｈ", "𝕄𝕒𝕥𝕙", "\U0010ffff")
RAW_STRINGS = ('"\\ud800"', '"\\udfff lone low"', '"\\ud83d\\ude00 pair"', '"\\u0000"',
               '"bad escape \\x41"')  # JSON string literals, some invalid
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "wizard", "", "USER",
         None, 1, ["user"], {"role": "user"})


@dataclass(frozen=True)
class FuzzCase:
    label: str  # which mutation, for the report
    path: str
    body: bytes
    content_type: str | None = "application/json"
    disconnect: bool = False  # leave after the first streamed line


@dataclass
class FuzzResult:
    case: FuzzCase
    status: int | str  # HTTP status, "timeout" or "error:<kind>"
    seconds: float
    detail: str = ""


@dataclass
class FuzzReport:
    results: list[FuzzResult] = field(default_factory=list)

    @property
    def by_status(self) -> dict[str, int]:
        return dict(sorted(Counter(str(r.status) for r in self.results).items()))

    def failures(self) -> list[FuzzResult]:
        """Server errors (>= 500), hangs (client timeout) and broken responses."""
        return [r for r in self.results if not isinstance(r.status, int) or r.status >= 500
                or r.detail.startswith("broken")]


def _dumps(body) -> bytes:
    """JSON with NaN / Infinity literals allowed (clients do send them)."""
    return json.dumps(body, allow_nan=True, ensure_ascii=False).encode("utf-8",
                                                                        "surrogatepass")


class CaseGenerator:
    """`cases(n)`: n seeded cases. Same seed, same cases."""

    def __init__(self, seed: int, vocab_size: int, max_model_len: int) -> None:
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def cases(self, count: int) -> list[FuzzCase]:
        mutations = [(self._field_value, 6), (self._field_type, 4), (self._token_ids, 3),
                     (self._messages, 4), (self._strings, 2), (self._invalid_json, 2),
                     (self._json_shape, 1), (self._content_type, 1), (self._valid_edge, 3),
                     (self._disconnect, 1)]
        funcs, weights = zip(*mutations)
        return [self.rng.choices(funcs, weights)[0]() for _ in range(count)]

    # --- valid starting points ----------------------------------------------------------------

    def _completion(self) -> dict:
        r = self.rng
        prompt = r.choice(["Hello", "The capital of France is", "1, 2, 3,",
                           [r.randrange(self.vocab_size) for _ in range(r.randint(1, 6))]])
        body = {"prompt": prompt, "max_tokens": r.randint(1, 2)}
        if r.random() < 0.3:
            body["stream"] = True
        if r.random() < 0.3:
            body["temperature"] = r.choice([0, 0.7, 1.0])
        return body

    def _chat(self) -> dict:
        body = {"messages": [{"role": "user", "content": self.rng.choice(["Hi", "2+2?"])}],
                "max_tokens": self.rng.randint(1, 2)}
        if self.rng.random() < 0.3:
            body["stream"] = True
        return body

    def _base(self) -> tuple[str, dict, tuple[str, ...]]:
        if self.rng.random() < 0.5:
            return "/v1/completions", self._completion(), COMPLETION_FIELDS
        return "/v1/chat/completions", self._chat(), CHAT_FIELDS

    def _case(self, label: str, path: str, body) -> FuzzCase:
        return FuzzCase(label, path, _dumps(body))

    # --- mutations ----------------------------------------------------------------------------

    def _field_value(self) -> FuzzCase:
        path, body, fields = self._base()
        name = self.rng.choice(fields)
        value = self.rng.choice(EXTREME_NUMBERS)
        body[name] = value
        if name not in ("max_tokens", "max_completion_tokens") and "max_tokens" in body:
            body["max_tokens"] = 2  # keep accepted cases cheap
        return self._case(f"value:{name}", path, body)

    def _random_json(self, depth: int = 0):
        r = self.rng
        kind = r.randrange(8 if depth < 3 else 5)
        if kind == 0:
            return r.choice([None, True, False])
        if kind == 1:
            return r.choice(EXTREME_NUMBERS)
        if kind == 2:
            return r.choice(UNICODE)
        if kind == 3:
            return ""
        if kind == 4:
            return r.randint(-5, 5)
        if kind == 5:
            return [self._random_json(depth + 1) for _ in range(r.randint(0, 3))]
        if kind == 6:
            return {r.choice(["a", "type", "text", "role", ""]): self._random_json(depth + 1)
                    for _ in range(r.randint(0, 3))}
        return [[r.randint(-3, 3)] for _ in range(r.randint(0, 3))]

    def _field_type(self) -> FuzzCase:
        path, body, fields = self._base()
        name = self.rng.choice(fields + ("unknown_field", "stream_options"))
        body[name] = self._random_json()
        return self._case(f"type:{name}", path, body)

    def _token_ids(self) -> FuzzCase:
        r, v = self.rng, self.vocab_size
        prompt = r.choice([
            [-1], [v], [v - 1], [0], [INT64_MAX], [INT64_MAX + 1], [2 ** 64], [1.5], [1.0],
            [True], [None], ["1"], [[]], [[1], [-5]], [[1], [v]], [[1, 2], "text"], [1, "a"],
            [[r.randrange(v)] * 3 for _ in range(r.randint(2, 4))],
            [r.randrange(v)] * (self.max_model_len - 1), [r.randrange(v)] * self.max_model_len,
            [r.randrange(v)] * (self.max_model_len * 50), [], [[]] * 3, [NAN], [INF]])
        body = {"prompt": prompt, "max_tokens": r.choice([1, 2, None])}
        if r.random() < 0.4:
            body["stop_token_ids"] = r.choice([[-1], [v], [2 ** 64], [0, v - 1], [1.5]])
        if r.random() < 0.3:
            body["stream"] = True
        return self._case("token_ids", "/v1/completions", body)

    def _messages(self) -> FuzzCase:
        r = self.rng
        one = {"role": "user", "content": "Hi"}
        messages = r.choice([
            [], None, "Hi", 5, {"role": "user", "content": "Hi"}, [None], [1, 2], ["Hi"],
            [[one]], [{}], [{"role": "user"}], [{"content": "Hi"}],
            [{"role": r.choice(ROLES), "content": "Hi"}],
            [{"role": "user", "content": r.choice([None, 5, True, {"a": 1}, [], [None], ["x"],
                                                    [{"type": "image_url", "image_url": {}}],
                                                    [{"type": "text"}],
                                                    [{"type": "text", "text": 5}],
                                                    [{"type": "text", "text": {"x": [1]}}],
                                                    [{"text": "no type"}], ""])}],
            [{"role": "assistant", "content": "only the assistant"}],
            [{"role": "system", "content": "only system"}],
            [{"role": "tool", "content": "tool", "tool_call_id": 5}],
            [{"role": "user", "content": "Hi", "name": {"x": 1}}],
            [dict(one) for _ in range(r.randint(2, 40))],
            [{"role": "user", "content": "x" * r.choice([1000, 100_000])}],
            [{"role": "user", "content": r.choice(UNICODE)}]])
        body = {"messages": messages, "max_tokens": r.choice([1, 2, None])}
        if r.random() < 0.3:
            body["stream"] = True
        return self._case("messages", "/v1/chat/completions", body)

    def _strings(self) -> FuzzCase:
        r = self.rng
        path, body, _ = self._base()
        text = r.choice(UNICODE + ("x" * 2_000_000, "ab" * 50_000, "\u00e9" * 100_000))
        where = r.choice(["prompt", "stop", "model", "user", "content"])
        if where == "prompt" and path == "/v1/completions":
            body["prompt"] = r.choice([text, [text, "Hi"]])
        elif where == "content" and path == "/v1/chat/completions":
            body["messages"][0]["content"] = text
        elif where == "stop":
            body["stop"] = r.choice([text, [text], [""], [text] * 20, "\u0000"])
        else:
            body[where] = text
        if len(text) > 1000:
            body["max_tokens"] = 1
        raw = _dumps(body)
        if r.random() < 0.3:  # a raw (maybe invalid) escape in place of a string value
            raw = raw.replace(b'"Hi"', r.choice(RAW_STRINGS).encode(), 1).replace(
                b'"Hello"', r.choice(RAW_STRINGS).encode(), 1)
        return FuzzCase(f"strings:{where}", path, raw)

    def _invalid_json(self) -> FuzzCase:
        r = self.rng
        path, body, _ = self._base()
        raw = _dumps(body)
        broken = r.choice([
            raw[: r.randrange(len(raw))], raw + b",", raw.replace(b'"', b"'"), b"", b"{",
            b"}", b"null", b"{prompt: 1}", b'{"prompt": "a",}', b"\xff\xfe\x00garbage",
            b"\xef\xbb\xbf" + raw, raw.replace(b":", b"=", 1), b'{"prompt": "a" "n": 1}',
            b'{"prompt": ' + b"1" * 5000 + b"}", b'{"n": 1e999999}', b'{"prompt": tru}',
            raw + b"\x00", b" " * 10_000, bytes(r.randrange(256) for _ in range(64))])
        return FuzzCase("invalid_json", path, broken)

    def _json_shape(self) -> FuzzCase:
        r = self.rng
        path = r.choice(["/v1/completions", "/v1/chat/completions"])
        depth = r.choice([50, 1000, 100_000])
        body = r.choice([
            b"[" * depth + b"]" * depth, b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}",
            b'{"messages": [{"role": "user", "content": ' + b'{"a":' * depth + b"1"
            + b"}" * depth + b"}]}",
            b"[]", b'"just a string"', b"42", b"true",
            _dumps([self._completion()]), _dumps({"prompt": "a", "prompt ": "b", "": 1})])
        return FuzzCase("json_shape", path, body)

    def _content_type(self) -> FuzzCase:
        path, body, _ = self._base()
        kind = self.rng.choice([None, "text/plain", "application/x-www-form-urlencoded",
                                "multipart/form-data; boundary=x", "application/json; "
                                "charset=latin-1", "application/xml", "*/*"])
        return FuzzCase(f"content_type:{kind}", path, _dumps(body), content_type=kind)

    def _valid_edge(self) -> FuzzCase:
        """Accepted-by-the-schema requests at the edges of what the engine must handle."""
        r = self.rng
        path, body, _ = self._base()
        edge = r.choice([
            {"temperature": 1e-300}, {"temperature": 5e-324}, {"top_p": 1e-300},
            {"top_p": 5e-324, "temperature": 1.0}, {"top_k": 1}, {"top_k": 10 ** 12},
            {"top_k": INT64_MAX}, {"top_k": 2 ** 64}, {"min_p": 1.0}, {"min_p": 1e-300},
            {"seed": INT64_MAX}, {"seed": -INT64_MAX - 1}, {"seed": 2 ** 64},
            {"seed": -(2 ** 64)}, {"n": 128, "max_tokens": 1}, {"n": 16, "stream": True},
            {"min_tokens": 2, "max_tokens": 2}, {"logprobs": 20, "n": 4}, {"ignore_eos": True},
            {"stop": ["a", "b", "c", "d"] * 5}, {"stop": "\ufffd"}, {"stop_token_ids": [0]},
            {"include_stop_str_in_output": True, "stop": [" "]}, {"skip_special_tokens": False},
            {"max_tokens": None}, {"stream": True, "stream_options": {"include_usage": True}},
            {"stream": False, "stream_options": {"include_usage": True}},
            {"logit_bias": {}}, {"tools": []}, {"response_format": {"type": "text"}},
            {"top_logprobs": 20, "logprobs": True}, {"return_token_ids": True, "n": 3},
            {"temperature": 2.0, "top_k": 1, "top_p": 0.0001, "min_p": 0.99},
            {"presence_penalty": 2.0, "frequency_penalty": -2.0}, {"repetition_penalty": 100},
            {"repetition_penalty": 1e-300}, {"logit_bias": {"0": 100, "1": -100}},
            {"logit_bias": {str(self.vocab_size - 1): 100}, "allowed_token_ids": [0]},
            {"allowed_token_ids": [self.vocab_size - 1], "min_tokens": 1, "max_tokens": 2},
            {"truncate_prompt_tokens": 1}, {"truncate_prompt_tokens": -1},
            {"use_beam_search": False, "length_penalty": 1.0}, {"unknown_vllm_field": 1}])
        body.update(edge)
        if path == "/v1/completions" and "top_logprobs" in edge:
            body["logprobs"] = 5
        return self._case("edge:" + ",".join(sorted(edge)), path, body)

    def _disconnect(self) -> FuzzCase:
        path, body, _ = self._base()
        body.update(stream=True, max_tokens=24, ignore_eos=True)
        return FuzzCase("disconnect", path, _dumps(body), disconnect=True)


def _check_body(case: FuzzCase, status: int, content: bytes, content_type: str) -> str:
    """'' if the response is well formed, else 'broken: ...'."""
    try:
        if status != 200 or not content_type.startswith("text/event-stream"):
            payload = json.loads(content)
            if status != 200 and not payload.get("error", {}).get("message"):
                return f"broken: error without a message: {content[:200]!r}"
            return ""
        lines = [line for line in content.decode().split("\n") if line.startswith("data:")]
        if not case.disconnect and (not lines or lines[-1] != "data: [DONE]"):
            return f"broken: stream not ended by [DONE]: {content[-200:]!r}"
        for line in lines[:-1]:
            json.loads(line[5:])
        return ""
    except (ValueError, AttributeError) as e:
        return f"broken: {type(e).__name__}: {content[:200]!r}"


async def _send(http: httpx.AsyncClient, case: FuzzCase, timeout_s: float) -> FuzzResult:
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", case.path, content=case.body,
                                   headers=headers) as response:
                if case.disconnect and response.status_code == 200:
                    async for _line in response.aiter_lines():
                        break  # leave mid-stream
                    return FuzzResult(case, 200, time.monotonic() - start, "left")
                content = await response.aread()
                detail = _check_body(case, response.status_code, content,
                                     response.headers.get("content-type", ""))
                if response.status_code >= 500:
                    detail = detail or content[:500].decode(errors="replace")
                return FuzzResult(case, response.status_code, time.monotonic() - start, detail)
    except TimeoutError:
        return FuzzResult(case, "timeout", time.monotonic() - start)
    except httpx.HTTPError as e:
        return FuzzResult(case, f"error:{type(e).__name__}", time.monotonic() - start, str(e))


async def run_cases(base_url: str, cases: list[FuzzCase], concurrency: int = 8,
                    timeout_s: float = 60.0, headers: dict | None = None) -> FuzzReport:
    """Send every case (at most `concurrency` at once, each bounded by `timeout_s`)."""
    report = FuzzReport()
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers or {},
                                 timeout=httpx.Timeout(timeout_s),
                                 limits=httpx.Limits(max_connections=concurrency)) as http:
        async def one(case: FuzzCase) -> None:
            async with semaphore:
                report.results.append(await _send(http, case, timeout_s))

        await asyncio.gather(*(one(case) for case in cases))
    return report
