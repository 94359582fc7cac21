"""One rank of an expert-parallel decode group in disaggregated serving
(`serve --decode-workers G --decode-data-parallel-size N --enable-expert-parallel`).

    front ──DecodeRequest──▶ rank r (a decode worker the decode router sees) ──pulls KV──▶ prefill
    rank 0 ◀──MoE dispatch/combine (torch.distributed)──▶ rank 1 ... rank N-1 (lockstep)

Each rank is an ordinary decode worker to the front (own id, own KV cache, own load reports,
so the decode router balances requests and KV tokens per rank, as DeepSeek does), but its MoE
layers hold only its expert slots and the group steps in lockstep: every iteration starts with
one all-reduce of a small header, so all ranks take the same branch, and a rank with nothing
to decode runs an empty step (the same collectives with no tokens). A step that raises on
one rank fails only its culprit request(s), agreed by the whole group (ep/lockstep_faults.py).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from deepinfer.cluster.decode_worker import DecodeWorkerLoop
from deepinfer.ep.ep_config import EPConfig
from deepinfer.ep.lockstep_faults import LockstepStepFaults
from deepinfer.wire.ep_messages import EPLBStats, WorkerEPLBStats

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.1  # an idle group re-agrees this often
BACKGROUND_POLL_MS = 5  # while any rank has a KV transfer in flight


@dataclass(frozen=True)
class EPRankSpec:
    """Where a decode worker sits in its EP group: `port` is the group's rendezvous (a fresh
    one per group start, so a restarted group never meets a stale rank)."""

    ep_config: EPConfig
    group_index: int
    rank: int
    port: int

    def build(self, spec, input_socket, output_socket):
        """The worker process's engine and loop (cluster/worker_proc calls this: it does not
        know expert parallelism, which sits above it)."""
        return build_ep_decode(spec, input_socket, output_socket)


class EPDecodeWorkerLoop(DecodeWorkerLoop):
    """`DecodeWorkerLoop` stepped in lockstep with its group. Header, one all-reduce:

        [ranks with a step to run, ranks shutting down, ranks with transfers in flight]
    """

    def __init__(self, spec, engine, input_socket, output_socket, transport, runtime,
                 rank_group) -> None:
        super().__init__(spec, engine, input_socket, output_socket, transport)
        self.runtime = runtime
        self.rank_group = rank_group
        self.step_faults = LockstepStepFaults(engine, runtime, rank_group, spec.role)
        self._group_busy = False
        self._group_background = False
        self._shutdown = False

    def run(self) -> None:
        idle_ms = int(min(IDLE_POLL_S, self.spec.report_interval_s) * 1000)
        while True:
            busy = self.has_step_work()
            background = self.has_background_work()
            timeout_ms = 0 if busy or self._group_busy else (
                BACKGROUND_POLL_MS if background or self._group_background else idle_ms)
            if not self._drain_inputs(timeout_ms):
                self._shutdown = True
            if self.spec.parent_pid is not None and os.getppid() != self.spec.parent_pid:
                logger.warning("front process is gone; %s leaving", self.spec.worker_id)
                self._shutdown = True
            self.before_step()
            busy = self.has_step_work()
            num_busy, num_shutdown, num_background = self.rank_group.all_reduce_cpu(
                [int(busy), int(self._shutdown), int(self.has_background_work())])
            if num_shutdown:
                from deepinfer.ep.process_group import destroy_rank_group
                destroy_rank_group()  # only on a clean exit: with a dead peer it could wait
                return
            self._group_busy, self._group_background = num_busy > 0, num_background > 0
            if self._group_busy:
                self._step(busy)
            if self._dirty or time.monotonic() - self._last_report >= self.spec.report_interval_s:
                self.send_report()
            self.last_iteration_time = time.monotonic()

    def _step(self, busy: bool) -> None:
        if busy:  # an empty schedule runs the empty step through the runner's hook
            outputs = self.engine.step()
            self.after_step(outputs)
            self._dirty = self._dirty or bool(outputs)
        else:
            self.step_faults.run_empty_step()
        report = self.runtime.end_step(False)
        if report is not None and self.rank_group.rank == 0:  # the same on every rank
            self.output_socket.send(self.encoder.encode(WorkerEPLBStats(
                self.spec.worker_id, EPLBStats.of(report, self.runtime))), copy=False)


def build_ep_decode(spec, input_socket, output_socket):
    """(engine, loop, transport, None) for a decode worker that is a rank of an EP group."""
    from deepinfer.cluster.decode_engine import DisaggDecodeEngine
    from deepinfer.cluster.kv_transport import ZmqKVTransport
    from deepinfer.ep.rank_proc import build_rank_engine

    ep: EPRankSpec = spec.ep_rank
    if spec.engine_config.speculative_config is not None:
        raise ValueError("speculative decoding on an expert-parallel decode group is not "
                         "supported (draft steps would break the group's lockstep)")
    engine, runtime, group = build_rank_engine(spec.engine_config, ep.ep_config, ep.rank,
                                               ep.port, engine_cls=DisaggDecodeEngine)
    transport = ZmqKVTransport(spec.host, serve=False)
    loop = EPDecodeWorkerLoop(spec, engine, input_socket, output_socket, transport, runtime,
                              group)
    return engine, loop, transport, None
