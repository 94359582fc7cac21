"""The front's handle on one group of rank processes: spawn, sockets, readiness, teardown.

An expert-parallel group is all of its ranks or nothing: they share the experts and step
together, so when one rank dies the others are killed too and the group is started again as
a whole (new port, new sockets: nothing queued for the old ranks reaches the new ones).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from deepinfer.ep.ep_config import EPConfig
from deepinfer.wire.ep_messages import EPLBStats, RankOutput
from deepinfer.ep.process_group import free_port
from deepinfer.ep.rank_proc import run_rank_proc
from deepinfer.engine.exceptions import EngineDeadError, exit_message
from deepinfer.wire.engine_messages import EngineDead, EngineOutputs, EngineReady, EngineStatsSnapshot
from deepinfer.wire import ChannelReceiver, ChannelSender, channel_name


@dataclass
class RankHandle:
    group: int
    rank: int  # within the group
    global_rank: int  # across groups: what `generate(rank=...)` pins to
    proc: multiprocessing.process.BaseProcess
    input: zmq.asyncio.Socket
    output: zmq.asyncio.Socket
    stats: EngineStatsSnapshot = field(default_factory=EngineStatsSnapshot)
    open_request_ids: set[str] = field(default_factory=set)
    num_requests_sent: int = 0
    ready: EngineReady | None = None
    # Sign what the front sends the rank, verify what it sends back (`with_channels`).
    sender: ChannelSender | None = None
    receiver: ChannelReceiver | None = None

    def with_channels(self, input_addr: str, output_addr: str) -> "RankHandle":
        """Names the rank's channels after its two endpoints (as `run_rank_proc` does)."""
        self.sender = ChannelSender(channel_name("engine.input", input_addr))
        self.receiver = ChannelReceiver(channel_name("engine.output", output_addr), RankOutput)
        return self

    @property
    def num_waiting_requests(self) -> int:
        in_flight = self.num_requests_sent - self.stats.num_requests_received
        return max(0, in_flight) + self.stats.num_waiting


@dataclass
class GroupHandle:
    index: int
    size: int
    ranks: list[RankHandle] = field(default_factory=list)
    healthy: bool = False
    dead_message: str | None = "not started"
    incarnation: int = 0
    healthy_since: float = 0.0
    eplb: EPLBStats | None = None  # the last rebalance
    eplb_history: list[EPLBStats] = field(default_factory=list)  # bounded: ep_metrics
    num_rebalances: int = 0  # over every incarnation
    moved_bytes: int = 0
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self, ctx: zmq.asyncio.Context, ipc_dir: str, engine_config,
                    ep_config: EPConfig, log_level: str, ready_timeout_s: float) -> None:
        """Start every rank, wait for each one's EngineReady and first report. Raises
        EngineDeadError (all of them killed) if any rank does not come up."""
        self.incarnation += 1
        self.ranks = []
        try:
            await self._start_ranks(ctx, ipc_dir, engine_config, ep_config, log_level,
                                    time.monotonic() + ready_timeout_s)
        except BaseException:
            await self.kill()
            raise
        self.healthy, self.dead_message = True, None
        self.healthy_since = time.monotonic()
        self.lost.clear()

    async def _start_ranks(self, ctx, ipc_dir: str, engine_config, ep_config: EPConfig,
                           log_level: str, deadline: float) -> None:
        """Spawn the ranks as processes of this machine (ipc sockets, 127.0.0.1 rendezvous)
        and wait until every one is up; a Ray group places actors instead."""
        port = free_port() if ep_config.enable_expert_parallel else None
        spawn = multiprocessing.get_context("spawn")
        for r in range(self.size):
            name = f"ipc://{ipc_dir}/g{self.index}-r{r}-{self.incarnation}-%s"
            input_socket, output_socket = front_sockets(ctx)
            input_socket.bind(name % "in")
            output_socket.bind(name % "out")
            handle = RankHandle(self.index, r, self.index * self.size + r, None, input_socket,
                                output_socket).with_channels(name % "in", name % "out")
            proc = spawn.Process(target=run_rank_proc, name=f"deepinfer-g{self.index}-rank{r}",
                                 daemon=True,
                                 args=(engine_config, ep_config, r, port, name % "in",
                                       name % "out", os.getpid(), log_level))
            proc.start()
            handle.proc = proc
            self.ranks.append(handle)
        await self._wait_all_up(deadline)

    async def _wait_all_up(self, deadline: float) -> None:
        await asyncio.gather(*(self._wait_up(h, max(1.0, deadline - time.monotonic()))
                               for h in self.ranks))

    @staticmethod
    async def _wait_up(handle: RankHandle, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await handle.output.poll(200):
                message = handle.receiver.decode(await handle.output.recv())  # None: dropped
                if isinstance(message, EngineReady):
                    handle.ready = message
                elif isinstance(message, EngineOutputs) and handle.ready is not None:
                    handle.stats = message.stats or handle.stats
                    return
                elif isinstance(message, EngineDead):
                    raise EngineDeadError(f"rank {handle.rank} failed to start:\n{message.message}")
            elif not handle.proc.is_alive():
                raise EngineDeadError(f"rank {handle.rank} {exit_message(handle.proc.exitcode)}")
        raise EngineDeadError(f"rank {handle.rank} not ready after {timeout_s:.0f} s")

    async def kill(self) -> None:
        """Kill every rank (no waiting on collectives) and close their sockets."""
        self.healthy = False
        for h in self.ranks:
            if h.proc.is_alive():
                h.proc.kill()
        for h in self.ranks:
            await asyncio.to_thread(h.proc.join, 10)
            for sock in (h.input, h.output):
                if not sock.closed:
                    sock.close(linger=0)


def front_sockets(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """The front's (input PUSH, output PULL) pair for one rank, unbound; no high-water marks,
    so neither side ever blocks on the other."""
    input_socket = ctx.socket(zmq.PUSH)
    input_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket = ctx.socket(zmq.PULL)
    output_socket.setsockopt(zmq.RCVHWM, 0)
    return input_socket, output_socket
