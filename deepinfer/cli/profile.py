"""`deepinfer profile --out profile.json`: measure this device's step costs for a model and fit
the compute-aware scheduler's cost model; prints the held-out prediction error."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def register(sub) -> None:
    p = sub.add_parser("profile", help="profile step costs and fit the scheduler's cost model")
    p.add_argument("--model", default=None,
                   help="GGUF file or HF folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", dest="num_threads", type=int, default=None,
                   help="CPU intra-op threads (default: all cores); profile with the count "
                        "you serve with")
    p.add_argument("--grid", choices=("full", "quick"), default="full",
                   help="full: ~minutes, more shapes; quick: the start-up grid")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per shape (median)")
    p.add_argument("--kv-cache-memory", default="2GiB",
                   help="KV memory the profiler's batches are spread over")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-host", dest="host", action="store_false",
                   help="skip the host measurements (engine-loop overhead per step, KV "
                        "transport) that the simulator adds to step times and transfers")
    p.add_argument("--host-sharing", type=int, default=0, metavar="N",
                   help="also measure how fast 1..N single-thread processes run at once on "
                        "this host (the simulator's host.sharing: measured); 0: skip")
    p.add_argument("--time-sharing", action="store_true",
                   help="also measure how much more CPU a step costs while a second process "
                        "time-shares its core (the simulator's host.time_sharing: measured)")
    p.add_argument("--memory-contention", action="store_true",
                   help="also measure how much more CPU a small decode step costs while "
                        "another process runs a decode / a prefill on another core (the "
                        "simulator's host.memory_contention: measured)")
    p.add_argument("--update", default=None, metavar="PROFILE",
                   help="skip the grid: copy this existing profile, add the host measurements "
                        "asked for (--time-sharing, --host-sharing, --memory-contention) "
                        "and write it to --out")
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deepinfer.cli.main import CLIError

    if args.repeats is not None and args.repeats < 1:
        raise CLIError("--repeats must be at least 1")
    if args.host_sharing < 0:
        raise CLIError("--host-sharing must be >= 0")
    if args.update is not None:
        if not (args.time_sharing or args.host_sharing or args.memory_contention):
            raise CLIError("--update needs --time-sharing, --host-sharing or "
                           "--memory-contention")
        try:
            with open(args.update) as f:
                base = json.load(f)
            if not isinstance(base, dict) or not isinstance(base.get("metadata"), dict):
                raise ValueError("no metadata")
        except (OSError, ValueError) as e:
            raise CLIError(f"cannot read profile {args.update}: {e}") from None
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise CLIError(f"output folder does not exist: {out_dir}")
    import torch

    from deepinfer.core.model_shape import ModelShape
    from deepinfer.engine.engine_config import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.runtime.profiler import (FULL_GRID, QUICK_GRID, grid_with,
                                            measure_host_overhead, profile_cost_model)

    try:
        config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                              num_threads=args.num_threads, kv_cache_memory=args.kv_cache_memory,
                              block_size=args.block_size, scheduler="token-budget")
        engine = LLMEngine(config)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise CLIError(f"cannot load model: {e}") from None
    grid = FULL_GRID if args.grid == "full" else QUICK_GRID
    if args.repeats is not None:
        grid = grid_with(grid, num_repeats=args.repeats)
    dtype_bytes = torch.empty((), dtype=engine.dtype).element_size()
    shape = ModelShape.from_model_config(engine.model_config, dtype_bytes)
    start = time.monotonic()
    if args.update is not None:
        return _update(args, engine, base)

    def progress(done: int, total: int) -> None:
        sys.stderr.write(f"\rprofiling {done}/{total} steps ({time.monotonic() - start:.0f} s)")
        sys.stderr.flush()

    model = profile_cost_model(engine.runner, shape, engine.model_config.vocab_size, grid,
                               metadata={"model": engine.model_name, "dtype": args.dtype},
                               progress=progress)
    sys.stderr.write("\n")
    if args.host:
        model.metadata["host_overhead"] = measure_host_overhead(
            engine, after_step=_serving_loop_work(engine))
        model.metadata["kv_transport"] = _measure_transport(engine)
        model.metadata["store_publish"] = _measure_publish(engine)
    _measure_sharing(args, engine, model.metadata)
    with open(args.out, "w") as f:
        json.dump(model.to_dict(), f, indent=1)
    err = model.holdout_error
    print(f"model {engine.model_name} ({args.dtype}) on {model.metadata['device']}, "
          f"{model.metadata['threads']} threads, grid {grid.name}: "
          f"{model.metadata['num_train_steps']} fit + {err.num_samples} held-out steps "
          f"in {time.monotonic() - start:.0f} s (load average "
          f"{model.metadata['load_average_at_start']:.1f} -> "
          f"{model.metadata['load_average_at_end']:.1f})")
    for name, value in model.coefficients.items():
        print(f"  {name:20s} {value:.4g} s/unit")
    if model.small_decode is not None:
        print(f"decode-only steps of <= {model.small_decode.max_rows} rows (fused decode stack):")
        for name, value in model.small_decode.model.coefficients.items():
            print(f"  {name:20s} {value:.4g} s/unit")
    meta = model.metadata
    print(f"fit-set abs error:  median {meta['fit_median_abs_pct_error']:.1f}%, "
          f"p90 {meta['fit_p90_abs_pct_error']:.1f}%")
    print(f"held-out abs error: median {err.median_abs_pct_error:.1f}%, "
          f"p90 {err.p90_abs_pct_error:.1f}%")
    host = model.metadata.get("host_overhead")
    if host:
        print(f"engine loop outside the model step: {host['per_step_s'] * 1e3:.2f} ms per step "
              f"+ {host['per_request_s'] * 1e3:.3f} ms per request")
    publish = model.metadata.get("store_publish")
    if publish:
        print(f"publishing KV to an fs store: {publish['s_per_byte'] * 1e9:.3f} CPU-s per GB")
    _print_sharing(model.metadata)
    link = model.metadata.get("kv_transport")
    if link:
        print(f"KV transport (stage copy + pull + write): {link['latency_ms']:.2f} ms + "
              f"{link['bandwidth_gb_s']:.2f} GB/s")
        if "cpu_s_per_gb" in link:
            cpu = link["cpu_s_per_gb"]
            print(f"  its CPU per GB: sender {cpu['sender']:.3f} s, receiver "
                  f"{cpu['receiver']:.3f} s")
    print(f"wrote {args.out}")
    return 0


def _measure_sharing(args, engine, metadata: dict) -> None:
    if args.host_sharing > 0:
        from deepinfer.bench.host_contention import measure_host_sharing
        metadata["host_sharing"] = measure_host_sharing(args.host_sharing)
    # The competing process loads the same model, one thread (time-sharing, memory contention).
    rival = {"model": args.model, "dtype": args.dtype, "device": args.device, "num_threads": 1,
             "kv_cache_memory": args.kv_cache_memory, "block_size": args.block_size}
    if args.time_sharing:
        from deepinfer.bench.host_contention import measure_time_sharing
        metadata["time_sharing"] = measure_time_sharing(
            engine.runner, engine.model_config.vocab_size, rival)
    if args.memory_contention:
        from deepinfer.bench.host_contention import measure_memory_contention
        metadata["memory_contention"] = measure_memory_contention(
            engine.runner, engine.model_config.vocab_size, rival)


def _print_sharing(metadata: dict) -> None:
    sharing = metadata.get("host_sharing")
    if sharing:
        print("speed of k single-thread processes at once: " + ", ".join(
            f"k={k} {v:.2f}" for k, v in enumerate(sharing["speed"], 1)))
    ts = metadata.get("time_sharing")
    if ts:
        print("work per CPU-second on a time-shared core / alone: " + ", ".join(
            f"{k} {ts[k]:.3f}" for k in ("decode", "large_decode", "prefill") if k in ts)
            + f" (load average {ts['load_average']:.2f})")
    mc = metadata.get("memory_contention")
    if mc:
        print(f"small decode work per CPU-second with a neighbour on another core / alone: "
              f"decode {mc['decode_with_decode']:.3f}, prefill {mc['decode_with_prefill']:.3f}"
              f" (load average {mc['load_average']:.2f})")


def _update(args, engine, base: dict) -> int:
    """`--update`: the existing profile with the host measurements asked for added."""
    _measure_sharing(args, engine, base["metadata"])
    _print_sharing(base["metadata"])
    with open(args.out, "w") as f:
        json.dump(base, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def _serving_loop_work(engine):
    """What the serving engine loop does with a step's outputs besides `engine.step()`:
    output deltas, a stats snapshot and the encoded message (`cluster.engine_proc`)."""
    from deepinfer.cluster.engine_proc import OutputDeltaTracker, _stats_snapshot
    from deepinfer.wire.engine_messages import EngineOutputs, make_encoder

    tracker, encoder = OutputDeltaTracker(), make_encoder()

    def after_step(outputs: list) -> None:
        encoder.encode(EngineOutputs(outputs=[tracker.to_delta(o) for o in outputs], errors=[],
                                     stats=_stats_snapshot(engine, 0)))
    return after_step


def _measure_transport(engine) -> dict | None:
    from deepinfer.cluster.kv_transport import ZmqKVTransport
    from deepinfer.runtime.profiler import measure_kv_transport
    try:
        return measure_kv_transport(engine, lambda serve: ZmqKVTransport(serve=serve))
    except (RuntimeError, OSError) as e:  # no loopback TCP: the simulator falls back
        print(f"KV transport not measured: {e}", file=sys.stderr)
        return None


def _measure_publish(engine) -> dict:
    """What a prefill worker does per computed block with an fs shared store
    (`SharedPrefixTier.publish` + its writer thread), into a temporary folder."""
    import secrets
    import shutil
    import tempfile

    from deepinfer.cluster.prefix_store_tier import block_axis_of, layout_for_cache
    from deepinfer.kvstore import KVStoreWriter
    from deepinfer.kvstore.factory import open_store
    from deepinfer.kvstore.tensor_codec import kv_block_to_bytes
    from deepinfer.runtime.profiler import measure_store_publish

    root = tempfile.mkdtemp(prefix="deepinfer-profile-store-")
    layout, axis = layout_for_cache(engine.cache), block_axis_of(engine.cache)
    store = open_store(f"fs://{root}", secrets.token_bytes(16), layout=layout.descriptor)
    writer = KVStoreWriter(store)

    def publish(kv) -> None:
        for i in range(kv.shape[axis]):
            writer.submit(secrets.token_bytes(16), kv_block_to_bytes(kv.narrow(axis, i, 1),
                                                                     layout))
    try:
        return measure_store_publish(engine, publish, lambda: writer.flush(60))
    finally:
        writer.close()
        store.close()
        shutil.rmtree(root, ignore_errors=True)
