"""`DataParallelClient`: the front's client of data-parallel rank processes
(`deepinfer serve --data-parallel-size N [--enable-expert-parallel]`).

    front ──▶ least-loaded rank of a healthy group ──▶ that rank's engine (own KV cache)
           ◀── deltas from every rank (one reader task per rank)

Groups: with expert parallelism a group is the N ranks that share the experts; without it
every rank is a group of its own. A rank that dies (or reports EngineDead) takes its whole
group out of routing at once: the group's other ranks are killed (no waiting on collective
timeouts), its requests fail with a clear error, except those that had streamed nothing yet,
which are sent again to another healthy group. With a restart policy the group is started
again with back-off (EngineRestartPolicy, as the colocated engine).
"""
from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from deepinfer.clients.engine_supervisor import EngineRestartPolicy
from deepinfer.clients.request_stream import StreamFailed, check_new_stream, engine_error
from deepinfer.engine.exceptions import EngineDeadError, exit_message
from deepinfer.ep.ep_config import EPConfig
from deepinfer.wire.ep_messages import EPLBStats, ForceRebalance, WakeUp
from deepinfer.ep.ep_metrics import record_rebalance
from deepinfer.ep.rank_group_handle import GroupHandle, RankHandle
from deepinfer.sampling_params import SamplingParams
from deepinfer.wire.engine_messages import (AbortRequest, AddRequest, EngineDead, EngineOutputs,
                                       EngineStatsSnapshot, RequestDelta, Shutdown, make_encoder)
from deepinfer.wire import tokenizer_from_files
from deepinfer.wire.drops import sum_reports

logger = logging.getLogger(__name__)

ROOT_CAUSE_GRACE_S = 0.5
_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
             "prediction_abs_error_sum", "num_predicted_steps")


class _Track:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rank: RankHandle | None = None


class DataParallelClient:
    supports_prompt_logprobs = False  # rank loops do not forward them

    def __init__(self, engine_config, ep_config: EPConfig, *, ready_timeout_s: float = 600.0,
                 log_level: str = "WARNING",
                 restart_policy: EngineRestartPolicy | None = None) -> None:
        self.engine_config = engine_config
        self.ep_config = ep_config
        self.ready_timeout_s = ready_timeout_s
        self.log_level = log_level
        self.policy = restart_policy or EngineRestartPolicy(0)
        ep = ep_config.enable_expert_parallel
        size = ep_config.data_parallel_size if ep else 1
        num = ep_config.num_groups * (1 if ep else ep_config.data_parallel_size)
        self.groups = [GroupHandle(i, size) for i in range(num)]
        self.model_name, self.max_model_len, self.vocab_size, self.tokenizer = "", 0, 0, None
        self.num_restarts = 0
        self.redundant_expert_bytes = 0
        self._tracks: dict[str, _Track] = {}
        self._tasks: dict[int, list[asyncio.Task]] = {}
        self._supervisors: list[asyncio.Task] = []
        self._stats_base = EngineStatsSnapshot()
        self._encoder = make_encoder()  # the payload; each rank's channel signs its copy
        self._ipc_dir = tempfile.mkdtemp(prefix="deepinfer-dp-")
        self._ctx = zmq.asyncio.Context()
        self._closing = False

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every group; ValueError if the model cannot run with these settings."""
        from deepinfer.runtime.model_source import resolve_model
        model_config = resolve_model(self.engine_config.model).config
        self.ep_config.check_model(model_config)
        self.redundant_expert_bytes = self.ep_config.redundant_expert_bytes(
            model_config, self.engine_config.dtype)
        results = await asyncio.gather(*(self._start_group(g) for g in self.groups),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == len(self.groups):
            raise errors[0]
        for error in errors:
            logger.error("a group failed to start: %s", error)
        if self.policy.max_restarts > 0:
            self._supervisors = [asyncio.create_task(self._supervise(g), name=f"dp-group-{g.index}")
                                 for g in self.groups]

    async def _start_group(self, group: GroupHandle) -> None:
        await group.start(self._ctx, self._ipc_dir, self.engine_config, self.ep_config,
                          self.log_level, self.ready_timeout_s)
        ready = group.ranks[0].ready
        self.model_name, self.max_model_len = ready.model_name, ready.max_model_len
        self.vocab_size = ready.vocab_size
        if self.tokenizer is None:
            self.tokenizer = tokenizer_from_files(ready.tokenizer_files)
        self._tasks[group.index] = [
            asyncio.create_task(self._output_loop(group, h, group.incarnation),
                                name=f"dp-out-g{group.index}-r{h.rank}") for h in group.ranks]

    async def _supervise(self, group: GroupHandle) -> None:
        attempt = 0
        while True:
            await group.lost.wait()
            if time.monotonic() - group.healthy_since >= self.policy.stable_after_s:
                attempt = 0
            while True:
                attempt += 1
                if attempt > self.policy.max_restarts:
                    logger.error("group %d: giving up after %d restarts", group.index, attempt - 1)
                    return
                await asyncio.sleep(self.policy.backoff_s(attempt))
                try:
                    await self._start_group(group)
                except Exception as e:
                    logger.error("group %d restart %d failed: %s", group.index, attempt,
                                 str(e).strip().splitlines()[-1:])
                    continue
                self.num_restarts += 1
                logger.warning("group %d restarted; re-admitting traffic", group.index)
                break

    async def shutdown(self) -> None:
        self._closing = True
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        for group in self.groups:
            for h in group.ranks:
                if h.proc.is_alive() and not h.input.closed:
                    try:
                        await h.input.send(h.sender.encode(Shutdown()), flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
        for group in self.groups:
            for h in group.ranks:
                await asyncio.to_thread(h.proc.join, 10)
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for group in self.groups:
            await group.kill()
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # --- state the API server reads ----------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return any(g.healthy for g in self.groups)

    @property
    def dead_message(self) -> str | None:
        if self.is_healthy:
            return None
        return next((g.dead_message for g in self.groups if g.dead_message), "no group running")

    @property
    def ranks(self) -> list[RankHandle]:
        return [h for g in self.groups if g.healthy for h in g.ranks]

    @property
    def stats(self) -> EngineStatsSnapshot:
        """Gauges summed over live ranks (KV usage: their mean); counters over every rank ever."""
        ranks = self.ranks
        total = {name: sum(getattr(h.stats, name) for h in ranks) for name in (
            "num_running", "num_waiting", "num_kv_blocks_used", "num_kv_blocks_total",
            "num_requests_received") + _COUNTERS}
        for name in _COUNTERS:
            total[name] += getattr(self._stats_base, name)
        usage = sum(h.stats.kv_cache_usage for h in ranks) / len(ranks) if ranks else 0.0
        step = max((h.stats.step_time_s or 0.0 for h in ranks), default=None)
        drops = sum_reports(h.stats.wire_frames_dropped for h in ranks)
        return EngineStatsSnapshot(kv_cache_usage=usage, step_time_s=step,
                                   wire_frames_dropped=drops, **total)

    @property
    def num_waiting_requests(self) -> int:
        return sum(h.num_waiting_requests for h in self.ranks)

    def register_metrics(self, registry) -> None:
        from deepinfer.ep.ep_metrics import DataParallelCollector
        from deepinfer.clients.restart_metrics import EngineRestartsCollector
        registry.register(EngineRestartsCollector(lambda: self.num_restarts, self.model_name))
        registry.register(DataParallelCollector(self, self.model_name))

    # --- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, arrival_time: float | None = None,
                       mm_inputs=None, *, rank: int | None = None,
                       ) -> AsyncIterator[RequestDelta]:
        """As ColocatedClient.generate (`mm_inputs`: the prompt's images, for the rank's own
        vision tower); `rank` pins the request to one global rank (tests)."""
        check_new_stream(self._tracks, request_id)
        try:
            frame = self._encoder.encode(AddRequest(request_id, list(prompt_token_ids), params,
                                                    arrival_time or time.monotonic(),
                                                    mm_inputs=mm_inputs))
        except (OverflowError, TypeError) as e:
            raise ValueError(f"invalid request parameters: {e}") from None
        track = _Track(request_id)
        self._tracks[request_id] = track
        tried: set[int] = set()
        finished = streamed = False
        try:
            while not finished:
                target = self._pick_rank(rank, tried)
                tried.add(target.group)
                await self._send_request(track, target, frame)
                while not finished:
                    item = await track.queue.get()
                    if isinstance(item, StreamFailed):
                        if item.group_lost and not streamed and rank is None and self._can_route(tried):
                            logger.warning("%s: group %d lost before any output; sending it to "
                                           "another group", request_id, target.group)
                            break
                        finished = True
                        raise item.error
                    finished = item.finished
                    streamed = streamed or any(c.token_ids or c.text for c in item.choices)
                    yield item
        finally:
            self._tracks.pop(request_id, None)
            if track.rank is not None:
                track.rank.open_request_ids.discard(request_id)
                if not finished and track.rank.proc.is_alive():
                    await self._send(track.rank, AbortRequest([request_id]))

    def _can_route(self, exclude: set[int]) -> bool:
        return any(g.healthy and g.index not in exclude for g in self.groups)

    def _pick_rank(self, pinned: int | None, exclude: set[int]) -> RankHandle:
        """The least loaded rank of a healthy group: fewest open requests, then KV in use."""
        if pinned is not None:
            for h in self.ranks:
                if h.global_rank == pinned:
                    return h
            raise EngineDeadError(f"rank {pinned} is not serving")
        ranks = [h for h in self.ranks if h.group not in exclude]
        if not ranks:
            raise EngineDeadError(self.dead_message or "no group is serving")
        return min(ranks, key=lambda h: (len(h.open_request_ids), h.stats.num_kv_blocks_used,
                                         h.global_rank))

    async def _send_request(self, track: _Track, target: RankHandle, frame: bytes) -> None:
        track.rank = target
        target.open_request_ids.add(track.request_id)
        target.num_requests_sent += 1
        try:
            await target.input.send(target.sender.sign(frame), copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"rank {target.global_rank} is not reachable ({e})") from None
        for peer in self.groups[target.group].ranks:
            if peer is not target:
                await self._send_frame(peer, peer.sender.encode(WakeUp()))

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            track = self._tracks.get(request_id)
            if track is not None and track.rank is not None:
                await self._send(track.rank, AbortRequest([request_id]))

    async def rebalance_now(self) -> None:
        """Ask every healthy group to rebalance its experts at its next step."""
        for group in self.groups:
            if group.healthy:
                await self._send(group.ranks[0], ForceRebalance())

    async def _send(self, handle: RankHandle, message) -> None:
        await self._send_frame(handle, handle.sender.encode(message))

    @staticmethod
    async def _send_frame(handle: RankHandle, frame: bytes) -> None:
        if handle.input.closed:
            return
        try:
            await handle.input.send(frame, copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a dead rank's group is being torn down

    # --- outputs and faults ------------------------------------------------------------------
    async def _output_loop(self, group: GroupHandle, handle: RankHandle, incarnation: int) -> None:
        decoder = handle.receiver  # None for a dropped frame (counted)
        while group.incarnation == incarnation:
            try:
                if not await handle.output.poll(200):
                    if not handle.proc.is_alive():
                        await self._on_group_lost(group, incarnation, f"rank {handle.rank} "
                                                  f"{exit_message(handle.proc.exitcode)}")
                        return
                    continue
                message = decoder.decode(await handle.output.recv())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a corrupt frame (or a socket closed under us)
                if handle.output.closed:
                    return
                logger.exception("bad message from rank %d: %s", handle.global_rank, e)
                continue
            if isinstance(message, EngineOutputs):
                self._dispatch(handle, message)
            elif isinstance(message, EPLBStats):
                record_rebalance(group, message)
            elif isinstance(message, EngineDead):
                last = (message.message.strip().splitlines() or ["?"])[-1]
                await self._on_group_lost(group, incarnation, f"rank {handle.rank} failed: {last}")
                return

    def _dispatch(self, handle: RankHandle, message: EngineOutputs) -> None:
        if message.stats is not None:
            handle.stats = message.stats
        for delta in message.outputs:
            track = self._tracks.get(delta.request_id)
            if track is not None and track.rank is handle:
                track.queue.put_nowait(delta)
        for error in message.errors:
            track = self._tracks.get(error.request_id)
            if track is not None and track.rank is handle:
                track.queue.put_nowait(StreamFailed(engine_error(error)))

    async def _on_group_lost(self, group: GroupHandle, incarnation: int, reason: str) -> None:
        if group.incarnation != incarnation or not group.healthy or self._closing:
            return
        group.healthy = False  # out of routing now; nothing else re-enters below
        # A peer's failed collective can be reported a moment before the killed rank's exit
        # is visible: wait briefly (bounded) for a rank killed by a signal to name the cause.
        deadline = time.monotonic() + ROOT_CAUSE_GRACE_S
        cause = _root_cause(group)
        while cause is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            cause = _root_cause(group)
        message = f"data-parallel group {group.index} lost: {cause or reason}"
        if self.policy.max_restarts > 0:
            message += "; restarting it"
        logger.error(message)
        group.dead_message = message
        for track in list(self._tracks.values()):
            if track.rank is not None and track.rank.group == group.index:
                track.queue.put_nowait(StreamFailed(EngineDeadError(message), group_lost=True))
        for h in group.ranks:
            for name in _COUNTERS:
                setattr(self._stats_base, name,
                        getattr(self._stats_base, name) + getattr(h.stats, name))
        current = asyncio.current_task()
        others = [t for t in self._tasks.pop(group.index, []) if t is not current]
        await group.kill()
        for task in others:
            task.cancel()
        group.lost.set()


def _root_cause(group: GroupHandle) -> str | None:
    """A rank killed by a signal explains its peers' failed collectives better than they do."""
    for handle in group.ranks:
        code = handle.proc.exitcode  # None while running (and for a stopped process)
        if code is not None and code < 0:
            return f"rank {handle.rank} {exit_message(code)}"
    return None
