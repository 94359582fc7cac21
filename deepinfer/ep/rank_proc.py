"""One rank process of a data-parallel / expert-parallel group (spawn target).

    front PUSH ──AddRequest / AbortRequest / Shutdown / WakeUp / ForceRebalance──▶ rank r
    front PULL ◀──EngineReady / EngineOutputs / EPLBStats / EngineDead────────────── rank r

The rank owns a whole engine (scheduler, KV cache, requests: attention is data parallel).
With expert parallelism its MoE layers hold only its expert slots and the group steps in
lockstep (rank_loop.RankLoop); without it the rank is an independent engine (EngineLoop).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from deepinfer.cluster.engine_proc import engine_ready
from deepinfer.cluster.process_shell import Serving, run_process
from deepinfer.ep.ep_config import EPConfig
from deepinfer.wire.engine_messages import EngineDead


def rank_device(engine_config, rank: int) -> torch.device:
    from deepinfer.engine.llm_engine import resolve_device
    device = resolve_device(engine_config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    return device


def build_rank_engine(engine_config, ep_config: EPConfig, rank: int, port: int | None,
                      engine_cls=None, master_addr: str = "127.0.0.1"):
    """(LLMEngine, ExpertParallelRuntime | None, RankGroup | None) for this rank. `engine_cls`:
    an LLMEngine subclass (e.g. the disaggregated decode engine of an EP decode rank). The group
    rendezvous is at master_addr:port (rank 0's node IP on Ray)."""
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.runtime.cpu_elementwise_kernels import install_elementwise_kernels
    from deepinfer.runtime.cpu_linear_packing import pack_linear_weights
    from deepinfer.runtime.model_source import load_model, resolve_model

    device = rank_device(engine_config, rank)
    world = ep_config.data_parallel_size
    # All ranks on this machine's GPUs (local launcher); a Ray actor sees only its own GPU.
    if device.type == "cuda" and ep_config.enable_expert_parallel and \
            master_addr == "127.0.0.1" and \
            torch.cuda.device_count() < world and ep_config.backend in (None, "nccl"):
        raise ValueError(f"{world} NCCL ranks need {world} GPUs, found {torch.cuda.device_count()}")
    threads = engine_config.num_threads or max(1, (os.cpu_count() or 1) // world)
    config = dataclasses.replace(engine_config, device=str(device), num_threads=threads)
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    source = resolve_model(config.model)
    runtime = group = None
    if ep_config.enable_expert_parallel:
        from deepinfer.ep.process_group import init_rank_group
        from deepinfer.ep.rank_weights import load_rank_model
        from deepinfer.moe.expert_parallel import ExpertParallelRuntime

        group = init_rank_group(rank, world, port, device, ep_config.backend,
                                ep_config.collective_timeout_s, host=master_addr)
        # Only this rank's slots' experts are read into memory (ep/rank_weights.py).
        model, runtime = load_rank_model(
            source, getattr(torch, config.dtype), device,
            lambda m: ExpertParallelRuntime(
                m, rank, world, ep_config.dispatcher,
                ep_config.eplb if ep_config.enable_eplb else None,
                ep_config.num_redundant_experts, load_slots=False))
    else:
        model = load_model(source, getattr(torch, config.dtype), device)
    if device.type == "cpu":  # as LLMEngine does for a model it loads itself
        pack_linear_weights(model)
        install_elementwise_kernels(model)
    engine = (engine_cls or LLMEngine)(config, source=source, model=model)
    if runtime is not None:
        engine.runner.empty_step_hook = runtime.run_empty_step
        engine.grammar_admission.background = False  # a rank's steps stay in lockstep
    return engine, runtime, group


def run_rank_proc(engine_config, ep_config: EPConfig, rank: int, port: int | None,
                  input_addr: str, output_addr: str, parent_pid: int | None,
                  log_level: str = "WARNING", master_addr: str = "127.0.0.1") -> None:
    def build(ctx, input_socket, output_socket) -> Serving:
        engine, runtime, group = build_rank_engine(engine_config, ep_config, rank, port,
                                                   master_addr=master_addr)
        endpoints = (input_addr, output_addr)
        if runtime is None:
            from deepinfer.cluster.engine_proc import EngineLoop
            run = EngineLoop(engine, input_socket, output_socket, parent_pid,
                             endpoints=endpoints).run
        else:
            from deepinfer.ep.rank_loop import RankLoop
            loop = RankLoop(engine, runtime, group, input_socket, output_socket, parent_pid,
                            endpoints=endpoints)

            def run() -> None:
                loop.run()
                from deepinfer.ep.process_group import destroy_rank_group
                destroy_rank_group()  # only on a clean exit: with a dead peer it could wait
        return Serving(engine_ready(engine, with_tokenizer=rank == 0), run)

    # a death report takes the group out of routing at the front
    run_process(f"rank {rank}", log_level, input_addr, output_addr, "engine.output", build,
                lambda message: EngineDead(message=message))
