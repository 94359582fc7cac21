"""POST /admin/scale and GET /admin/workers on the real app over a fake client, and the
`deepinfer scale` CLI against that app: the API key is required (or loopback without one),
bad bodies are 400 naming the field, a colocated server says 501, and the CLI prints the
outcome or exits 2 with one line."""
from __future__ import annotations

import argparse
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from deepinfer.cli.errors import CLIError
from deepinfer.server.api_server import ServerConfig, build_app
from deepinfer.wire.engine_messages import EngineStatsSnapshot

KEY = "sekrit"


class FakeClusterClient:
    model_name, max_model_len, num_waiting_requests, is_healthy = "m", 64, 0, True
    stats = EngineStatsSnapshot()

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def scale(self, role: str, count: int, wait: bool = True) -> dict:
        if count > 8:
            raise ValueError("count must be an integer from 1 to 8")
        self.calls.append((role, count, wait))
        return {"role": role, "count": count, "added": [f"{role}-1"], "removed": [],
                "not_ready": [], "num_released": 0}

    def describe_workers(self) -> list[dict]:
        return [{"worker_id": "decode-0", "role": "decode", "state": "alive"},
                {"worker_id": "decode-1", "role": "decode", "state": "alive"}]


class FakeColocatedClient:
    model_name, max_model_len, num_waiting_requests, is_healthy = "m", 64, 0, True
    stats = EngineStatsSnapshot()


def app_for(client, api_key=KEY) -> TestClient:
    return TestClient(build_app(client, ServerConfig(api_key=api_key, enable_admin_api=True)))


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_scale_needs_the_api_key_and_calls_the_client():
    client = FakeClusterClient()
    http = app_for(client)
    assert http.post("/admin/scale", json={"role": "decode", "count": 2}).status_code == 401
    assert http.get("/admin/workers").status_code == 401
    r = http.post("/admin/scale", json={"role": "decode", "count": 2}, headers=AUTH)
    assert r.status_code == 200 and r.json()["added"] == ["decode-1"]
    assert len(r.json()["workers"]) == 2 and client.calls == [("decode", 2, True)]
    assert http.get("/admin/workers", headers=AUTH).json()["workers"][1]["worker_id"] == "decode-1"


@pytest.mark.parametrize("body, param", [
    ({"role": "encode", "count": 1}, "role"), ({"role": "decode", "count": 0}, "count"),
    ({"role": "decode"}, "count"), ({"role": "decode", "count": 1, "extra": 1}, "extra"),
])
def test_bad_scale_bodies_are_400_naming_the_field(body, param):
    client = FakeClusterClient()
    r = app_for(client).post("/admin/scale", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    assert client.calls == []


def test_client_refusal_is_400_and_colocated_is_501():
    r = app_for(FakeClusterClient()).post("/admin/scale", json={"role": "decode", "count": 9},
                                          headers=AUTH)
    assert r.status_code == 400 and "count must" in r.json()["error"]["message"]
    r = app_for(FakeColocatedClient()).post("/admin/scale", json={"role": "decode", "count": 2},
                                            headers=AUTH)
    assert r.status_code == 501 and "--prefill-workers" in r.json()["error"]["message"]


def test_admin_is_off_unless_enabled_and_enabled_only_with_a_key():
    off = TestClient(build_app(FakeClusterClient(), ServerConfig(api_key=KEY)))
    for method, path in (("post", "/admin/scale"), ("get", "/admin/workers"), ("get", "/admin/x")):
        r = getattr(off, method)(path, headers=AUTH)
        assert r.status_code == 404 and "--enable-admin-api" in r.json()["error"]["message"]
    # No caller is trusted for where it calls from: without any key it does not start.
    with pytest.raises(ValueError, match="--admin-api-key or --api-key"):
        build_app(FakeClusterClient(), ServerConfig(enable_admin_api=True))


def test_serve_refuses_the_admin_api_without_a_key(capsys):
    from deepinfer.cli.main import main
    assert main(["serve", "--enable-admin-api", "--port", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "--enable-admin-api needs --admin-api-key or --api-key" in err[-1]


def cli_args(**kw) -> argparse.Namespace:
    base = dict(role="decode", count=2, base_url="http://server", api_key=KEY, no_wait=False,
                timeout=30.0)
    return argparse.Namespace(**{**base, **kw})


def transport_to(http: TestClient) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        r = http.request(request.method, request.url.path, content=request.content,
                         headers=dict(request.headers))
        return httpx.Response(r.status_code, content=r.content, headers=r.headers)
    return httpx.MockTransport(handle)


def test_scale_cli_prints_the_outcome(capsys):
    from deepinfer.cli.scale import run
    client = FakeClusterClient()
    assert run(cli_args(no_wait=True), transport=transport_to(app_for(client))) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["added"] == ["decode-1"] and out["workers"] == ["decode-0:alive", "decode-1:alive"]
    assert client.calls == [("decode", 2, False)]


def test_scale_cli_errors_are_one_line():
    from deepinfer.cli.scale import run
    http = app_for(FakeClusterClient())
    with pytest.raises(CLIError, match="HTTP 401: Invalid or missing API key"):
        run(cli_args(api_key=None), transport=transport_to(http))
    with pytest.raises(CLIError, match="HTTP 400: count must"):
        run(cli_args(count=9), transport=transport_to(http))
    with pytest.raises(CLIError, match="--count must be at least 1"):
        run(cli_args(count=0), transport=transport_to(http))


def test_scale_is_a_registered_subcommand():
    from deepinfer.cli.main import build_parser
    args = build_parser().parse_args(["scale", "--role", "prefill", "--count", "3"])
    assert (args.role, args.count, args.base_url) == ("prefill", 3, "http://127.0.0.1:8000")
