"""Process entry of one prefill or decode worker: what it builds and announces, in the one
worker-process shape (`process_shell.py`)."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import zmq

from deepinfer.wire.worker_messages import WorkerFailed, WorkerHeartbeat, WorkerReady
from deepinfer.cluster.process_shell import Serving, run_process, set_routing_id
from deepinfer.cluster.worker_spec import WorkerSpec
from deepinfer.engine.step_faults import isolate_step_faults
from deepinfer.wire import ChannelSender, channel_name, tokenizer_to_files
from deepinfer.wire.hello import HEARTBEAT_SLOT, HelloRefused, say_hello

logger = logging.getLogger(__name__)
HELLO_TRY_S = 2.0


def _build_prefill(spec: WorkerSpec, input_socket, output_socket):
    from deepinfer.cluster.kv_transport import ZmqKVTransport
    from deepinfer.cluster.prefill_worker import PrefillWorkerLoop
    from deepinfer.cluster.prefix_store_tier import (SharedPrefixTier, layout_for_cache,
                                                     store_salt)
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.kvstore import open_store

    # Speculative decoding runs on decode workers only: a prefill worker samples one token.
    engine = LLMEngine(dataclasses.replace(spec.engine_config, speculative_config=None))
    transport = ZmqKVTransport(spec.host, serve=True)
    tier = None
    if spec.kv_store_url is not None:
        layout = layout_for_cache(engine.cache)
        salt = store_salt(layout, engine.source, engine.config.block_size)
        store = open_store(spec.kv_store_url, salt, layout=layout.descriptor)
        tier = SharedPrefixTier(store, engine.cache, engine.scheduler.kv, layout)
    isolate_step_faults(engine, spec.role)  # the loop answers the requests a step fails
    loop = PrefillWorkerLoop(spec, engine, input_socket, output_socket, transport, tier)
    return engine, loop, transport, tier


def _build_decode(spec: WorkerSpec, input_socket, output_socket):
    if spec.ep_rank is not None:  # a rank of an expert-parallel decode group: its spec
        return spec.ep_rank.build(spec, input_socket, output_socket)  # knows how (ep/)
    from deepinfer.cluster.decode_engine import DisaggDecodeEngine
    from deepinfer.cluster.decode_worker import DecodeWorkerLoop
    from deepinfer.cluster.kv_transport import ZmqKVTransport

    engine = DisaggDecodeEngine(spec.engine_config)
    isolate_step_faults(engine, spec.role)  # not EP ranks: their steps run in lockstep
    transport = ZmqKVTransport(spec.host, serve=False)
    loop = DecodeWorkerLoop(spec, engine, input_socket, output_socket, transport)
    return engine, loop, transport, None


def _heartbeat_thread(spec: WorkerSpec, ctx: zmq.Context, loop, stop: threading.Event) -> None:
    """Own socket (ZMQ sockets are not thread-safe), proven as this worker's heartbeat
    connection; beats while the loop is inside a step."""
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    set_routing_id(socket)
    socket.connect(spec.output_addr)
    while True:  # in short tries: a stop while the front does not answer must not hang
        if stop.is_set():
            socket.close(linger=0)
            return
        try:
            say_hello(socket, spec.worker_id, spec.output_addr, HELLO_TRY_S, slot=HEARTBEAT_SLOT)
            break
        except HelloRefused:
            logger.warning("the front has not welcomed the heartbeat connection yet")
    encoder = worker_output_sender(spec.output_addr)  # its own sequence: its own socket
    while not stop.wait(spec.report_interval_s):
        age = time.monotonic() - loop.last_iteration_time
        socket.send(encoder.encode(WorkerHeartbeat(spec.worker_id, age)))
    socket.close(linger=0)


def worker_output_sender(output_addr: str) -> ChannelSender:
    return ChannelSender(channel_name("worker.output", output_addr))


def run_worker_proc(spec: WorkerSpec) -> None:
    """Spawn target. Exits on ShutdownWorker, when the front process is gone, or on error
    (after sending `WorkerFailed`)."""
    if spec.cpu_ids is not None:
        from deepinfer.cluster.cpu_affinity import pin_to_cpus
        pin_to_cpus(spec.cpu_ids)  # before torch starts its threads
    run_process(spec.worker_id, spec.log_level, spec.input_addr, spec.output_addr,
                "worker.output", lambda ctx, i, o: _serving(spec, ctx, i, o),
                lambda message: WorkerFailed(spec.worker_id, message), hello=True)


def _serving(spec: WorkerSpec, ctx: zmq.Context, input_socket, output_socket) -> Serving:
    build = _build_prefill if spec.role == "prefill" else _build_decode
    engine, loop, transport, tier = build(spec, input_socket, output_socket)
    kv = engine.scheduler.kv
    ready = WorkerReady(
        worker_id=spec.worker_id, role=spec.role, pid=os.getpid(),
        kv_addr=transport.address or None, model_name=engine.model_name,
        max_model_len=int(engine.max_model_len),
        vocab_size=int(engine.model_config.vocab_size), block_size=kv.block_size,
        num_kv_blocks=kv.num_blocks, max_num_seqs=engine.scheduler.config.max_num_seqs,
        tokenizer_files=tokenizer_to_files(engine.tokenizer),
        weights_fingerprint=engine.source.weights_fingerprint())

    def run() -> None:
        stop = threading.Event()
        beat = threading.Thread(target=_heartbeat_thread, args=(spec, ctx, loop, stop),
                                name="heartbeat", daemon=True)
        beat.start()
        try:
            loop.run()
        finally:
            stop.set()
            beat.join(2.0)

    closers = [c.close for c in (tier, transport) if c is not None]
    return Serving(ready, run, closers)
