"""The HTTP front's connection cap: past `--max-connections` open connections a new request
gets a 503 (uvicorn's limit_concurrency through `uvicorn_options`), and once connections close
requests are served again. The default stays below the open-file limit."""
from __future__ import annotations

import asyncio
import resource
import socket
import threading
import time

import uvicorn

from deepinfer.cli.main import build_parser
from deepinfer.server.api_server import ServerConfig, uvicorn_options
from deepinfer.server.limit_args import limits_from_args
from deepinfer.server.request_limits import RequestLimits, default_max_connections
from tests.integration.serve_process import free_port


async def ok_app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def status_of_get(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return int(sock.makefile("rb").readline().split()[1])


def test_requests_past_the_connection_cap_get_503_until_connections_close():
    port = free_port()
    config = ServerConfig(host="127.0.0.1", port=port, log_level="warning",
                          limits=RequestLimits(max_connections=3))
    server = uvicorn.Server(uvicorn.Config(ok_app, **uvicorn_options(config)))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        assert status_of_get(port) == 200
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        time.sleep(0.2)  # the server has registered them
        assert status_of_get(port) == 503
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        assert status_of_get(port) == 200
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_the_flag_reaches_the_limits_and_the_default_leaves_descriptors_free():
    args = build_parser().parse_args(["serve", "--max-connections", "50"])
    assert limits_from_args(args).max_connections == 50
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert 32 <= default_max_connections() <= max(32, soft // 2)
    assert uvicorn_options(ServerConfig())["limit_concurrency"] == default_max_connections()
