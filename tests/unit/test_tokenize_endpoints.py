"""/tokenize and /detokenize behind the real app (vLLM's shapes): a prompt, a chat rendered
through the chat endpoint's own template path (the ids a chat request is given), token
strings, the text of ids, and 4xx for what they cannot take."""
from __future__ import annotations

from fastapi.testclient import TestClient

from deepinfer.server.api_server import ServerConfig, build_app
from tests.unit.fake_engine_client import VOCAB, CharTokenizer, FakeEngineClient


class TemplateTokenizer(CharTokenizer):
    bos_token_id = 1
    chat_template = "{% for tool in tools %}...{% endfor %}"  # a template that renders tools

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False,
                            tools=None, **kwargs):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        if tools:
            text = "[" + ",".join(t["function"]["name"] for t in tools) + "]" + text
        return text + ("<assistant>" if add_generation_prompt else "")

    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]


def client(**config):
    engine = FakeEngineClient()
    engine.tokenizer = TemplateTokenizer()
    return TestClient(build_app(engine, ServerConfig(**config))), engine


def test_a_prompt_is_tokenized_as_the_completions_endpoint_tokenizes_it():
    http, engine = client()
    r = http.post("/tokenize", json={"prompt": "hello", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = engine.tokenizer.encode("hello")
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == engine.max_model_len
    assert body["token_strs"] == [f"t{i}" for i in want]
    assert "token_strs" not in http.post("/tokenize", json={"prompt": "hello"}).json()
    # the same ids reach the engine for a completion of that prompt
    assert http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1}).status_code == 200
    assert engine.requests[-1][0] == want


def test_a_chat_is_rendered_with_the_chat_endpoints_template_and_tools():
    http, engine = client()
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    body = http.post("/tokenize", json={"messages": messages, "tools": tools}).json()
    assert body["tokens"] == engine.tokenizer.encode("[get_time]<user>hi<assistant>")
    no_prompt = http.post("/tokenize", json={"messages": messages,
                                             "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == engine.tokenizer.encode("<user>hi")
    # what a chat request with the same messages is given
    assert http.post("/v1/chat/completions", json={"messages": messages,
                                                   "max_tokens": 1}).status_code == 200
    assert engine.requests[-1][0] == engine.tokenizer.encode("<user>hi<assistant>")
    with_bos = http.post("/tokenize", json={"messages": messages,
                                            "add_special_tokens": True}).json()
    assert with_bos["tokens"][0] == 1 and with_bos["tokens"][1:] == engine.tokenizer.encode(
        "<user>hi<assistant>")


def test_detokenize_returns_the_text_of_the_ids():
    http, engine = client()
    ids = engine.tokenizer.encode("abc")
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": engine.tokenizer.decode(ids)}


def test_bad_requests_get_a_400_naming_the_field():
    http, _ = client()
    cases = [
        ("/tokenize", b"{not json", None),
        ("/tokenize", b"[1, 2]", None),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                       "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ("/tokenize", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         "messages"),
        ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ]
    # a model not served here is a 404 (model_not_found), as OpenAI and vLLM answer it
    r = http.post("/tokenize", json={"prompt": "x", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"
    for path, body, param in cases:
        r = (http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body))
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        error = r.json()["error"]
        if param is not None:
            assert error["param"] == param, (path, body, error)


def test_the_api_key_guards_both_endpoints():
    http, _ = client(api_key="k")
    assert http.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert http.post("/detokenize", json={"tokens": [11]}).status_code == 401
    ok = http.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200
