"""Prometheus collector for a disaggregated cluster: per-worker load and counters, router
decisions, retries, worker restarts. Read from the front's latest worker reports at scrape time."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "deepinfer:cluster_"

_GAUGES = (
    ("num_requests_running", "Running requests per worker.", lambda h: h.last_report.num_running_reqs),
    ("num_requests_waiting", "Waiting requests per worker (incl. KV transfers).",
     lambda h: h.last_report.num_waiting_reqs),
    ("kv_blocks_used", "KV blocks in use per worker.", lambda h: h.last_report.num_kv_blocks_used),
    ("kv_blocks_total", "KV blocks per worker.", lambda h: h.last_report.num_kv_blocks_total),
    ("kv_tokens", "KV tokens of running requests per worker.", lambda h: h.last_report.kv_tokens),
    ("kv_staged_bytes", "Prefill KV staged for decode, bytes.", lambda h: h.counters.staged_bytes),
)
_COUNTERS = (
    ("prefix_query_tokens", "Prompt tokens looked up.", lambda c: c.prefix_query_tokens),
    ("prefix_hit_tokens_device", "Prompt tokens found in the device prefix cache.",
     lambda c: c.device_hit_tokens),
    ("prefix_hit_tokens_store", "Prompt tokens loaded from the shared prefix store.",
     lambda c: c.store_hit_tokens),
    ("prefix_hit_tokens_host", "Prompt tokens loaded from the worker's host-memory tier.",
     lambda c: c.host_hit_tokens),
    ("store_loads_skipped", "Prompts whose stored prefix was recomputed (predicted cheaper "
     "than loading it).", lambda c: c.store_loads_skipped),
    ("store_read_timeouts", "Prompts whose store read outlived its budget (twice the "
     "predicted recompute time): admitted with what had arrived, the rest recomputed.",
     lambda c: c.store_read_timeouts),
    ("store_await_tokens", "Prompt tokens awaited from the store while another worker "
     "computed them.", lambda c: c.store_await_tokens),
    ("store_blocks_published", "Blocks queued for the store as their chunk was computed.",
     lambda c: c.store_blocks_published),
    ("store_read_bytes", "Bytes read from the shared store.", lambda c: c.store_bytes_read),
    ("store_written_bytes", "Bytes written to the shared store.", lambda c: c.store_bytes_written),
    ("store_corrupt_blocks", "Corrupt store blocks dropped.", lambda c: c.store_corrupt_blocks),
    ("kv_transfer_bytes", "KV bytes sent (prefill) or received (decode).",
     lambda c: c.transfer_bytes),
    ("kv_transfers", "KV transfers completed.", lambda c: c.num_transfers),
    ("kv_transfer_failures", "KV transfers failed, timed out or expired.",
     lambda c: c.num_transfer_failures),
    ("kv_transfer_seconds", "Total KV transfer time (decode side).",
     lambda c: c.transfer_seconds_total),
    ("engine_step_failures", "Engine steps that raised on this worker and were recovered "
     "from (the requests they were pinned on failed; the rest went on).",
     lambda c: c.num_failed_steps),
    ("engine_steps", "Engine steps run.", lambda c: c.num_engine_steps),
    ("model_step_seconds", "Seconds the model runner spent in those steps.",
     lambda c: c.model_step_seconds_total),
    ("loop_step_seconds", "Wall seconds of those steps with their output handling and report "
     "(minus model_step_seconds: the worker's host work per step).",
     lambda c: c.loop_step_seconds_total),
    ("process_cpu_seconds", "CPU seconds of the worker process (all threads).",
     lambda c: c.process_cpu_seconds),
    ("model_step_cpu_seconds", "Process CPU seconds inside the engine steps (model_step_seconds "
     "minus this: the steps' time runnable but descheduled, or blocked).",
     lambda c: c.model_step_cpu_seconds_total),
    ("idle_wait_seconds", "Wall seconds the loop waited for input with no step to run.",
     lambda c: c.idle_wait_seconds_total),
    ("prefilled_requests", "Prefill: prompts finished and handed off.",
     lambda c: c.num_prefilled_requests),
    ("prefill_computed_tokens", "Prefill: prompt tokens computed (not prefix-cache hits).",
     lambda c: c.prefill_computed_tokens),
    # Decode: where a request's time between tokens goes (per step: running vs served).
    ("decode_step_running_requests", "Decode: requests running at each step's start, summed "
     "over steps.", lambda c: c.decode_step_running_requests),
    ("decode_step_token_requests", "Decode: requests each step gave a token, summed over steps "
     "(less than decode_step_running_requests: requests that got none).",
     lambda c: c.decode_step_token_requests),
    ("decode_step_token_seconds", "Decode: each step's wall seconds times the requests it gave "
     "a token, summed (over decode_step_token_requests: the step time a token waits for; "
     "decode_token_gap_seconds minus this: the time between steps).",
     lambda c: c.decode_step_token_seconds_total),
    ("decode_step_pending_transfers", "Decode: requests waiting for their KV (allocation or "
     "pull) at each step's start, summed over steps.",
     lambda c: c.decode_step_pending_transfers),
    ("decode_token_gap_seconds", "Decode: seconds between a request's consecutive token "
     "emissions on this worker (its inter-token latency at the source), summed.",
     lambda c: c.decode_token_gap_seconds_total),
    ("decode_token_gaps", "Decode: those gaps counted.", lambda c: c.decode_token_gaps),
    ("decode_alloc_wait_seconds", "Decode: seconds from a DecodeRequest's arrival to its KV "
     "blocks' allocation, summed.", lambda c: c.decode_alloc_wait_seconds_total),
    ("decode_fetch_wait_seconds", "Decode: seconds from allocation to the pulled KV being "
     "picked up by the loop, summed.", lambda c: c.decode_fetch_wait_seconds_total),
    ("decode_kv_write_seconds", "Decode: seconds writing pulled KV into the cache and "
     "admitting the request, summed.", lambda c: c.decode_kv_write_seconds_total),
    ("decode_first_token_wait_seconds", "Decode: seconds from admission to the request's "
     "first token on this worker, summed.", lambda c: c.decode_first_token_wait_seconds_total),
    ("decode_admitted_requests", "Decode: requests admitted after their KV transfer.",
     lambda c: c.decode_admitted),
    ("between_steps_seconds", "Wall seconds between steps in the role's own work (decode: "
     "allocations, pulls, KV writes; not in loop_step_seconds).",
     lambda c: c.between_steps_seconds_total),
)


def spec_decode_totals(counters) -> dict:
    """The decode workers' speculative-decoding counters summed (per position too): the
    `EngineStatsSnapshot` fields behind the front's spec_decode_* metrics in P/D mode."""
    per_pos: list[int] = []
    for c in counters:
        for i, n in enumerate(c.spec_decode_num_accepted_tokens_per_pos):
            if i == len(per_pos):
                per_pos.append(0)
            per_pos[i] += n
    return {name: sum(getattr(c, name) for c in counters)
            for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                         "spec_decode_num_accepted_tokens")} | {
        "spec_decode_num_accepted_tokens_per_pos": per_pos}


class ClusterCollector:
    def __init__(self, client) -> None:
        self.client = client

    def collect(self):
        labels = ["worker_id", "role"]
        up = GaugeMetricFamily(PREFIX + "worker_up", "1 while the worker is routable.",
                               labels=labels)
        for h in self.client.workers.values():  # also the lost and restarting ones
            up.add_metric([h.worker_id, h.role], int(h.alive))
        yield up
        # A restarting worker has no report until its new process sends one.
        handles = [h for h in self.client.workers.values() if h.last_report is not None]
        for name, doc, get in _GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for h in handles:
                family.add_metric([h.worker_id, h.role], get(h))
            yield family
        for name, doc, get in _COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for h in handles:
                family.add_metric([h.worker_id, h.role], get(h.counters))
            yield family
        routed = CounterMetricFamily(PREFIX + "router_decisions", "Requests routed per worker.",
                                     labels=["worker_id", "role", "policy"])
        for role, router in (("prefill", self.client.prefill_router),
                             ("decode", self.client.decode_router)):
            for worker_id, count in sorted(router.num_routed.items()):
                routed.add_metric([worker_id, role, router.name], count)
        yield routed
        for name, doc, value in (
                ("request_retries", "Requests retried after losing a worker.",
                 self.client.health.num_retried),
                ("request_worker_loss_failures", "Requests failed because a worker was lost.",
                 self.client.health.num_failed_by_worker_loss),
                ("worker_suspensions", "Workers taken out of routing as unresponsive (silent, "
                 "or engine loop not advancing).", self.client.health.num_suspended),
                ("prefill_staging_full_decisions", "Prefill routing decisions taken with every "
                 "worker's KV staging full.", self.client.prefill_router.num_staging_full),
                ("prefill_awaited_prefixes", "Requests routed to await a prefix another prefill "
                 "worker was computing.", getattr(self.client.prefill_router, "num_awaited", 0))):
            family = CounterMetricFamily(PREFIX + name, doc)
            family.add_metric([], value)
            yield family
        yield from self._restart_metrics()

    def _restart_metrics(self):
        supervisor = self.client.supervisor
        for name, doc, counts in (
                ("worker_restarts", "Worker processes restarted after a loss, per role.",
                 supervisor.num_restarts),
                ("worker_restart_give_ups", "Workers given up on after too many restarts in a "
                 "row, per role.", supervisor.num_gave_up)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["role"])
            for role in ("prefill", "decode"):
                family.add_metric([role], counts[role])
            yield family
