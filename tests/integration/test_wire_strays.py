"""Stray peers on a running P1/D1 cluster's worker sockets: a local process that holds no
cluster secret connects a DEALER (which asks for a hello with another key) and a PULL to every
port the front binds for its workers (each worker's input ROUTER, the shared report ROUTER),
while greedy requests run. Not one frame reaches a stray (with PUSH inputs a PULL took a
round-robin share of a worker's prompts), every answer equals the offline engine's greedy
tokens, and the refused hello is counted."""
from __future__ import annotations

import os
import time

import psutil
import pytest
import zmq

from deepinfer.wire import ChannelSender
from deepinfer.wire.hello import HelloRequest, hello_channel
from deepinfer.wire.secret import SECRET_ENV
from tests.integration.serve_process import running_server
from tests.integration.test_wire_hostile import (PROMPT, _Completion, _reference, _wait_drops)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SECRET = "strays-test-secret-" + os.urandom(8).hex()
PROMPTS = [PROMPT, "The three primary colours are", "def fibonacci(n):",
           "The capital of France is"]


def front_listeners(pid: int, exclude_ports) -> list[str]:
    """The ports the front process itself listens on (not its workers' KV servers)."""
    return [f"tcp://127.0.0.1:{c.laddr.port}"
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port not in exclude_ports]


def test_strays_on_the_worker_ports_receive_nothing_under_load(engine_base_llm):
    tokenizer = engine_base_llm.get_tokenizer()
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    want = [_reference(engine_base_llm, i, 24) for i in ids]
    with running_server("--dtype", "float32", "--threads", "1", "--num-kv-blocks", "128",
                        "--max-model-len", "256", "--prefill-workers", "1",
                        "--decode-workers", "1", env={SECRET_ENV: SECRET}) as server:
        endpoints = front_listeners(server.proc.pid, {server.port})
        assert len(endpoints) == 3, endpoints  # report ROUTER, prefill-0's and decode-0's inputs
        ctx = zmq.Context()
        strays = []
        try:
            for endpoint in endpoints:
                for kind in (zmq.DEALER, zmq.PULL):
                    sock = ctx.socket(kind)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(endpoint)
                    strays.append(sock)
                strays[-2].send(ChannelSender(hello_channel(endpoint), os.urandom(32)).encode(
                    HelloRequest("prefill-0")))
            time.sleep(0.5)  # connected before the load starts
            for _ in range(2):  # under load: every prompt at once, twice
                requests = [_Completion(server.url, i, 24) for i in ids]
                for r in requests:
                    r.start()
                for r in requests:
                    r.join(120)
                assert [r.error for r in requests] == [None] * len(requests)
                assert [r.token_ids for r in requests] == want
            received = 0
            for sock in strays:
                while sock.poll(0):
                    sock.recv()
                    received += 1
            assert received == 0
        finally:
            for sock in strays:
                sock.close(linger=0)
            ctx.term()
        drops = _wait_drops(server.url, {("worker.hello", "key")})
        assert drops.get(("worker.hello", "key"), 0) >= len(endpoints), drops
        # The workers' own hellos and reports drew no drop (nothing lands on a bound
        # connection that is not a report of its worker).
        assert {k: v for k, v in drops.items() if k[0] != "worker.hello" and v} == {}, drops
