"""P/D mode: the front's /metrics sums the decode workers' speculative-decoding counters
(`spec_decode_*`, per position too) and counts host-tier prefix hits as hits, as colocated
serving reports them for one engine."""
from __future__ import annotations

from types import SimpleNamespace

from deepinfer.cluster.decode_worker import DecodeWorkerLoop
from deepinfer.clients.disagg import DisaggClient
from deepinfer.wire.worker_messages import WorkerCounters, WorkerLoadReport
from deepinfer.core.spec_decode_stats import SpecDecodeStats
from deepinfer.server.metrics import ServerMetrics


def decode_counters(drafts: list[tuple[int, int]]) -> WorkerCounters:
    """A decode worker's counters after verifying `drafts` ((drafted, accepted) each)."""
    stats = SpecDecodeStats()
    for drafted, accepted in drafts:
        stats.observe(drafted, accepted)
    worker = SimpleNamespace(engine=SimpleNamespace(scheduler=SimpleNamespace(spec_stats=stats)),
                             counters=WorkerCounters())
    DecodeWorkerLoop.update_counters(worker)
    return worker.counters


def cluster(*counters: WorkerCounters) -> SimpleNamespace:
    report = WorkerLoadReport(0, 0, 0, 0, 100, 16, 0, 8)
    handles = {f"w{i}": SimpleNamespace(alive=True, last_report=report, counters=c)
               for i, c in enumerate(counters)}
    return SimpleNamespace(workers=handles, encode_stage=None)  # no encode workers


def test_decode_workers_spec_counters_are_summed_on_the_front():
    d0 = decode_counters([(3, 3), (3, 1)])
    d1 = decode_counters([(4, 2), (2, 0), (4, 4)])
    prefill = WorkerCounters(prefix_query_tokens=100, device_hit_tokens=32,
                             store_hit_tokens=16, host_hit_tokens=16)
    assert (d0.spec_decode_num_drafts, d0.spec_decode_num_accepted_tokens) == (2, 4)
    snapshot = DisaggClient.stats.fget(cluster(prefill, d0, d1))
    assert snapshot.spec_decode_num_drafts == 5
    assert snapshot.spec_decode_num_draft_tokens == 16
    assert snapshot.spec_decode_num_accepted_tokens == 10
    assert snapshot.spec_decode_num_accepted_tokens_per_pos == [4, 3, 2, 1]
    assert snapshot.prefix_cache_hits == 64  # device + shared store + host tier
    text = ServerMetrics("m", lambda: snapshot).render().decode()
    assert 'deepinfer:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'deepinfer:spec_decode_num_accepted_tokens_total{model_name="m"} 10.0' in text
    assert ('deepinfer:spec_decode_num_accepted_tokens_per_pos_total'
            '{model_name="m",position="0"} 4.0') in text
