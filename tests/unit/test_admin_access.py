"""--admin-api-key: /admin/* need that key, the /v1 key does not open them, and the admin key
does not open /v1; without it, the /v1 key opens them. (They exist only with
--enable-admin-api.)"""
from __future__ import annotations

from fastapi.testclient import TestClient

from deepinfer.server.api_server import ServerConfig, build_app
from tests.unit.test_admin_scale import FakeClusterClient


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_admin_routes_need_the_admin_key_and_only_it():
    http = TestClient(build_app(FakeClusterClient(), ServerConfig(
        api_key="user", admin_api_key="admin", enable_admin_api=True)))
    for headers in ({}, bearer("user"), bearer("admin-but-longer"), bearer("admi")):
        r = http.get("/admin/workers", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert http.get("/admin/workers", headers=bearer("admin")).status_code == 200
    r = http.post("/admin/scale", json={"role": "decode", "count": 1}, headers=bearer("admin"))
    assert r.status_code == 200 and r.json()["added"] == ["decode-1"]
    assert http.get("/v1/models", headers=bearer("admin")).status_code == 401
    assert http.get("/v1/models", headers=bearer("user")).status_code == 200


def test_the_admin_key_alone_guards_admin_even_from_loopback():
    http = TestClient(build_app(FakeClusterClient(), ServerConfig(admin_api_key="admin",
                                                            enable_admin_api=True)),
                      client=("127.0.0.1", 5000))
    assert http.get("/admin/workers").status_code == 401
    assert http.get("/admin/workers", headers=bearer("admin")).status_code == 200
    assert http.get("/v1/models").status_code == 200  # no --api-key: /v1 stays open


def test_without_an_admin_key_the_api_key_opens_admin_and_loopback_is_not_trusted():
    keyed = TestClient(build_app(FakeClusterClient(), ServerConfig(api_key="user",
                                                                   enable_admin_api=True)),
                       client=("127.0.0.1", 5000))
    assert keyed.get("/admin/workers").status_code == 401  # loopback is no credential
    assert keyed.get("/admin/workers", headers=bearer("user")).status_code == 200


def test_metrics_behind_the_api_key_only_when_asked():
    open_metrics = TestClient(build_app(FakeClusterClient(), ServerConfig(api_key="user")))
    assert open_metrics.get("/metrics").status_code == 200
    keyed = TestClient(build_app(FakeClusterClient(), ServerConfig(
        api_key="user", metrics_need_api_key=True)))
    assert keyed.get("/metrics").status_code == 401
    r = keyed.get("/metrics", headers=bearer("user"))
    assert r.status_code == 200 and "deepinfer:" in r.text
    assert keyed.get("/health").status_code == 200
