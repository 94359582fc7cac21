"""API fuzz: a few hundred seeded malformed and edge-case OpenAI requests against a real
`deepinfer serve`. None may get a 5xx or hang (each is bounded by a client timeout), no
request may kill the engine, no KV block may leak, and afterwards the server still answers a
normal request with the same greedy output as before. The longer run is
benchmarks/api_fuzz.py."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.integration.api_fuzz_cases import CaseGenerator, run_cases
from tests.integration.serve_process import metric, scrape_metrics, wait_for_metric

SEED = 20240607
NUM_CASES = 300
VOCAB_SIZE = 49152  # SmolLM2, the default model
MAX_MODEL_LEN = 64  # the small server's (serve_process.SMALL_SERVER_ARGS)
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
          "return_token_ids": True}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fuzzed_requests_get_no_5xx_no_hang_and_the_server_keeps_serving(small_server):
    url = small_server.url
    before = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=60)
    assert before.status_code == 200, before.text
    samples = scrape_metrics(url)
    restarts = metric(samples, "deepinfer:engine_restarts_total")
    idle_kv = metric(samples, "deepinfer:kv_cache_usage_perc")

    cases = CaseGenerator(SEED, VOCAB_SIZE, MAX_MODEL_LEN).cases(NUM_CASES)
    report = asyncio.run(run_cases(url, cases, concurrency=8, timeout_s=60))

    failures = [(r.case.label, r.status, r.case.body[:200], r.detail[:300])
                for r in report.failures()]
    assert not failures, f"{len(failures)} failures; by status {report.by_status}:\n" + \
        "\n".join(map(str, failures[:20]))
    assert len(report.results) == NUM_CASES
    by_status = report.by_status
    assert by_status.get("400", 0) > NUM_CASES / 3 and by_status.get("200", 0) > 20, by_status
    # Nothing killed the engine, nothing leaked, and it still serves correctly.
    assert metric(scrape_metrics(url), "deepinfer:engine_restarts_total") == restarts
    assert wait_for_metric(url, "deepinfer:num_requests_running", lambda v: v == 0) == 0
    assert wait_for_metric(url, "deepinfer:kv_cache_usage_perc",
                           lambda v: v == idle_kv) == idle_kv
    after = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=60)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["token_ids"] == before.json()["choices"][0]["token_ids"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_engine_loop_rejects_a_request_it_cannot_add_instead_of_dying():
    """Not only ValueError: any error adding one request is that request's error."""
    from types import SimpleNamespace

    from deepinfer.sampling_params import SamplingParams
    from deepinfer.cluster.engine_proc import EngineLoop
    from deepinfer.wire.engine_messages import AddRequest

    def add_request(*args, **kwargs):
        raise OverflowError("Python int too large to convert to C long")

    loop = EngineLoop(SimpleNamespace(add_request=add_request), None, None)
    loop._handle(AddRequest("r1", [1, 2], SamplingParams(), 0.0))
    [error] = loop._pending_errors
    assert error.request_id == "r1" and "OverflowError" in error.message
