"""`EPDisaggClient`: a disaggregated cluster whose decode workers are expert-parallel groups
(`serve --prefill-workers P --decode-workers G --decode-data-parallel-size N
--enable-expert-parallel`).

    prefill workers ──KV──▶ decode-0 decode-1 ... decode-(N-1)   group 0 (lockstep, shared experts)
                            decode-N ...       decode-(2N-1)     group 1
    decode router: sees every rank as a decode worker (running requests + KV tokens per rank)

Everything else is `DisaggClient`'s. What differs is faults (`EPGroupHealth`): a rank cannot step without its
peers, so a rank lost or unresponsive takes its whole group out of routing at once (the peers
are killed, not left waiting on collective timeouts), and a group is restarted as a whole, all
ranks together on a fresh rendezvous port. A request the lost group had streamed nothing for
whose KV is still staged on its prefill worker goes to a rank of another group (which pulls
that KV); the others fail with a clear error naming the group and the rank that died, as does
a retry whose pull finds the KV gone (the lost rank had pulled it before the front heard).
Rank 0 of each group reports every rebalance (`WorkerEPLBStats`): the EPLB metrics on /metrics.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from deepinfer.clients.disagg import DisaggClient
from deepinfer.clients.disagg_health import WorkerHealth
from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.wire.worker_messages import PrefillDone, WorkerMessage
from deepinfer.cluster.worker_handle import WorkerHandle
from deepinfer.cluster.worker_supervisor import WorkerState
from deepinfer.engine.exceptions import EngineDeadError
from deepinfer.ep.decode_rank import EPRankSpec
from deepinfer.ep.ep_config import EPConfig
from deepinfer.ep.ep_metrics import DecodeGroupEPLBCollector, GroupEPLB, record_rebalance
from deepinfer.wire.ep_messages import WorkerEPLBStats
from deepinfer.ep.process_group import free_port

logger = logging.getLogger(__name__)
ROOT_CAUSE_GRACE_S = 0.5  # how long a failed rank's peers are watched for the one that died




class EPDisaggClient(DisaggClient):
    def __init__(self, engine_config, cluster: ClusterConfig, decode_ep: EPConfig,
                 launcher=None) -> None:
        if not decode_ep.enable_expert_parallel:
            raise ValueError("EPDisaggClient needs an expert-parallel decode config")
        self.decode_ep = decode_ep
        self.num_decode_groups = cluster.num_decode_workers
        ranks = cluster.num_decode_workers * decode_ep.data_parallel_size
        super().__init__(engine_config, dataclasses.replace(cluster, num_decode_workers=ranks),
                         launcher=launcher)
        self._group_ports: dict[int, int] = {}
        self.decode_group_eplb = [GroupEPLB(g) for g in range(self.num_decode_groups)]
        self.redundant_expert_bytes = 0
        # request id -> (its PrefillDone, tokens streamed when it went to decode): enough to
        # send it to another group while its KV is still staged on the prefill worker.
        self._decode_sent: dict[str, tuple[PrefillDone, int]] = {}
        # request id -> the group loss it was retried after: a retry that still fails (the lost
        # rank had pulled the KV unbeknown to us) says why it was moved.
        self._retried_after: dict[str, str] = {}
        self.health = EPGroupHealth(self)

    async def start(self) -> None:
        from deepinfer.runtime.model_source import resolve_model
        self.redundant_expert_bytes = self.decode_ep.redundant_expert_bytes(
            resolve_model(self.engine_config.model).config, self.engine_config.dtype)
        self._group_ports = {g: free_port() for g in range(self.num_decode_groups)}
        await super().start()

    def _worker_message_type(self):
        return WorkerMessage | WorkerEPLBStats

    def register_metrics(self, registry) -> None:
        super().register_metrics(registry)
        registry.register(DecodeGroupEPLBCollector(self))

    def _on_other_message(self, message) -> None:
        if not isinstance(message, WorkerEPLBStats):
            return
        handle = self.workers.get(message.worker_id)
        if handle is not None and handle.spec.ep_rank is not None:
            record_rebalance(self.decode_group_eplb[handle.spec.ep_rank.group_index],
                             message.stats)

    def _make_handle(self, role: str, index: int) -> WorkerHandle:
        handle = super()._make_handle(role, index)
        if role == "decode":
            group, rank = divmod(index, self.decode_ep.data_parallel_size)
            handle.spec = dataclasses.replace(handle.spec, ep_rank=EPRankSpec(
                self.decode_ep, group, rank, self._group_ports[group]))
        return handle

    def group_members(self, handle: WorkerHandle) -> list[WorkerHandle]:
        """Every rank of `handle`'s EP group (itself included), by rank; [] for a prefill
        worker."""
        ep = handle.spec.ep_rank
        if ep is None:
            return []
        return sorted((h for h in self.workers.values() if h.spec.ep_rank is not None
                       and h.spec.ep_rank.group_index == ep.group_index),
                      key=lambda h: h.spec.ep_rank.rank)

    async def scale(self, role: str, count: int, wait: bool = True) -> dict:
        if role == "decode":
            raise ValueError("scaling decode workers that are expert-parallel groups is not "
                             "supported")
        return await super().scale(role, count, wait)

    async def _send_decode(self, track, done: PrefillDone) -> None:
        self._decode_sent[track.request_id] = (done, track.num_tokens_streamed)
        await super()._send_decode(track, done)

    def _forget_placement(self, track) -> None:
        self._decode_sent.pop(track.request_id, None)
        self._retried_after.pop(track.request_id, None)
        super()._forget_placement(track)

    async def _give_up(self, track, error: Exception) -> None:
        loss = self._retried_after.pop(track.request_id, None)
        if loss is not None and isinstance(error, EngineDeadError):
            error = EngineDeadError(f"{loss}; retried on {track.decode_worker}: {error}")
        await super()._give_up(track, error)


class EPGroupHealth(WorkerHealth):
    """`WorkerHealth` of a cluster whose decode workers are EP group ranks: a group lives
    and dies as one."""

    async def on_worker_dead(self, worker_id: str, reason: str) -> None:
        handle = self.client.workers[worker_id]
        root = await self._root_cause(handle)
        if root is not None:  # e.g. a peer's collective failed because this rank was killed
            handle, worker_id = root, root.worker_id
            reason = f"process exited ({root.proc.exitcode})"
        if handle.alive or handle.suspended_since is not None:
            for peer in self.client.group_members(handle):  # no request moves to a doomed peer
                self.client.decode_router.remove_worker(peer.worker_id)
        await super().on_worker_dead(worker_id, reason)
        for peer in self.client.group_members(handle):
            if peer.alive or peer.suspended_since is not None:
                await super().on_worker_dead(peer.worker_id, self._group_reason(handle, reason))

    async def _root_cause(self, handle: WorkerHandle) -> WorkerHandle | None:
        """A peer of `handle` whose process exited, if one does within a short grace: a rank
        killed mid-collective makes its peers fail at once, often before its exit is seen,
        and the report should name the rank that died, not the ones it took down."""
        if handle.spec.ep_rank is None or (handle.proc is not None and
                                           not handle.proc.is_alive()):
            return None
        deadline = time.monotonic() + ROOT_CAUSE_GRACE_S
        while True:
            for peer in self.client.group_members(handle):
                if peer is not handle and peer.alive and peer.proc is not None \
                        and not peer.proc.is_alive():
                    return peer
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.02)

    async def release_requests(self, handle: WorkerHandle, reason: str) -> None:
        """A lost rank's requests: those it streamed nothing for and whose KV is still staged
        on the prefill worker go to a rank of another healthy group, once; the rest fail with
        a clear error (`WorkerHealth.release_requests`)."""
        if handle.spec.ep_rank is not None and self._other_group_routable(handle):
            for request_id in sorted(handle.request_ids):
                track = self.client._requests.get(request_id)
                sent = self.client._decode_sent.get(request_id)
                if track is None or track.failed or sent is None or track.phase != "decode" \
                        or track.decode_worker != handle.worker_id or not track.kv_pending \
                        or track.num_tokens_streamed != sent[1] or track.num_retries:
                    continue
                handle.request_ids.discard(request_id)
                self.client.decode_router.on_request_aborted(request_id, handle.worker_id)
                track.num_retries += 1
                self.num_retried += 1
                track.last_progress = time.monotonic()
                self.client._retried_after[request_id] = self._group_reason(handle, reason)
                logger.warning("%s: decode retried on another group (%s)", request_id,
                               self.client._retried_after[request_id])
                # fails it clearly if no other group can take it
                await self.client._send_decode(track, sent[0])
        await super().release_requests(handle, reason)

    def _other_group_routable(self, handle: WorkerHandle) -> bool:
        group = {m.worker_id for m in self.client.group_members(handle)}
        return any(load.worker_id not in group for load in self.client._loads("decode"))

    async def suspend_worker(self, worker_id: str, reason: str) -> None:
        """An unresponsive rank stalls its peers' collectives: the group is lost, not paused."""
        if self.client.workers[worker_id].spec.ep_rank is None:
            await super().suspend_worker(worker_id, reason)
        else:
            await self.on_worker_dead(worker_id, f"unresponsive ({reason})")

    def on_worker_lost(self, handle: WorkerHandle, reason: str) -> None:
        super().on_worker_lost(handle, reason)
        for peer in self.client.group_members(handle):
            if peer is handle:
                continue
            state = self.client.supervisor.state(peer.worker_id)
            if state is WorkerState.STARTING:  # a group restart that cannot form any more
                if peer.proc is not None and peer.proc.is_alive():
                    peer.proc.kill()
                super().on_worker_lost(peer, self._group_reason(handle, reason))
            elif peer.alive or peer.suspended_since is not None:
                self.client._tasks.append(asyncio.get_running_loop().create_task(
                    self.on_worker_dead(peer.worker_id, self._group_reason(handle, reason))))

    def restart_worker(self, worker_id: str) -> None:
        """Restart the whole group at once, on a fresh rendezvous port, when all its ranks
        wait for a restart (the first one due starts them all)."""
        handle = self.client.workers[worker_id]
        if handle.spec.ep_rank is None:
            super().restart_worker(worker_id)
            return
        members = self.client.group_members(handle)
        supervisor = self.client.supervisor
        if any(supervisor.state(m.worker_id) is not WorkerState.BACKOFF for m in members):
            return  # started with its group already, or a peer gave up / is still going down
        port = free_port()
        for member in members:
            member.spec = dataclasses.replace(member.spec, ep_rank=dataclasses.replace(
                member.spec.ep_rank, port=port))
            super().restart_worker(member.worker_id)

    @staticmethod
    def _group_reason(handle: WorkerHandle, reason: str) -> str:
        return (f"expert-parallel decode group {handle.spec.ep_rank.group_index} lost: "
                f"{handle.worker_id} {reason}")
