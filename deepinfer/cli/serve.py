"""`deepinfer serve`: the OpenAI-compatible server (engine in its own process).

`--demo` (used by `make run`) sends one chat request through the official `openai` client once
the server is up, prints the answer, and keeps serving until Ctrl-C.
"""
from __future__ import annotations

import asyncio
import socket
import sys

from deepinfer.engine.engine_args import add_engine_args, engine_config_from_args

DEMO_QUESTION = "What is the capital of France? Answer in one sentence."
# Waiting requests beyond this get a 429 (a burst cannot queue without bound); 0 lifts it.
DEFAULT_MAX_WAITING = 1024


def register(sub) -> None:
    from deepinfer.arg_groups import create_groups, group
    from deepinfer.ep.ep_args import add_parallel_args
    from deepinfer.cluster.cluster_args import add_cluster_args
    from deepinfer.multimodal.media_args import add_media_args
    from deepinfer.server.chat_options import add_chat_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    create_groups(p)  # topic order in --help, whichever module adds its flags first
    add_engine_args(p)
    g = group(p, "server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--uvicorn-log-level", default="warning")
    g.add_argument("--demo", action="store_true",
                   help="send one chat request with the openai client once ready, print it")
    g.add_argument("--demo-question", default=DEMO_QUESTION)
    g = group(p, "security")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    g.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help="file holding the secret that signs every frame between this server's "
                        "processes (the same file on every host of a multi-host cluster; else "
                        "$DEEPINFER_CLUSTER_SECRET, else a random one per start)")
    group(p, "scheduling").add_argument(
        "--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING,
        help="answer 429 when this many requests are already waiting "
             f"(default {DEFAULT_MAX_WAITING}; 0: no limit)")
    group(p, "health").add_argument(
        "--max-engine-restarts", type=int, default=5,
        help="restart a dead engine process (with back-off) up to this many times in a row; "
             "0: never (default: 5)")
    from deepinfer.server.limit_args import add_limit_args
    add_limit_args(p)
    add_cluster_args(p)
    add_parallel_args(p)
    add_media_args(p)
    add_chat_args(p)
    p.set_defaults(func=_run)


def _check_port_free(host: str, port: int) -> None:
    from deepinfer.cli.main import CLIError

    if not 0 < port < 65536:
        raise CLIError(f"--port must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise CLIError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _announce(host: str, port: int) -> None:
    print(f"DeepInfer OpenAI-compatible server on http://{host}:{port}/v1 (Ctrl-C to stop)",
          flush=True)


def _demo(api_key: str | None, question: str, host: str, port: int) -> None:
    """Runs in a worker thread once the port is open."""
    _announce(host, port)
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{host}:{port}/v1", api_key=api_key or "none")
    model = client.models.list().data[0].id
    print(f"> {question}", flush=True)
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=64,
        temperature=0.0)
    usage = response.usage
    print(f"< {response.choices[0].message.content}", flush=True)
    print(f"({usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens; "
          "still serving, Ctrl-C to stop)", flush=True)


def _decode_ep_config(args, ep_config, engine_config):
    """Disaggregated serving: the EP config of each decode worker's group (None: plain decode
    workers). The colocated group flags do not apply there."""
    from deepinfer.cli.main import CLIError
    if args.data_parallel_size > 1 or args.ep_groups > 1:
        raise CLIError("with --prefill-workers/--decode-workers, size decode groups with "
                       "--decode-data-parallel-size and their number with --decode-workers "
                       "(--data-parallel-size and --ep-groups are for colocated serving)")
    if ep_config is None or not ep_config.enable_expert_parallel:
        return None
    import dataclasses
    try:
        decode_ep = dataclasses.replace(ep_config,
                                        data_parallel_size=args.decode_data_parallel_size)
        from deepinfer.runtime.model_source import resolve_model
        decode_ep.check_model(resolve_model(engine_config.model).config)
    except (OSError, ValueError) as e:
        raise CLIError(str(e)) from None
    return decode_ep


def _run(args) -> int:
    from deepinfer.cli.main import CLIError
    from deepinfer.clients.engine_supervisor import EngineRestartPolicy
    from deepinfer.engine.exceptions import EngineDeadError
    from deepinfer.server.api_server import ServerConfig, run_server

    try:
        engine_config = engine_config_from_args(args)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.max_waiting_requests < 0:
        raise CLIError("--max-waiting-requests must be >= 0 (0: no limit)")
    if args.enable_admin_api and not (args.admin_api_key or args.api_key):
        raise CLIError("--enable-admin-api needs --admin-api-key or --api-key")
    if args.metrics_need_api_key and not args.api_key:
        raise CLIError("--metrics-need-api-key needs --api-key")
    if args.loop_stall_timeout <= 0:
        raise CLIError("--loop-stall-timeout must be > 0 seconds")
    if args.max_engine_restarts < 0:
        raise CLIError("--max-engine-restarts must be >= 0")
    from deepinfer.ep.ep_args import ep_config_from_args
    try:
        ep_config = ep_config_from_args(args, engine_config)  # None: one engine process
    except ValueError as e:
        raise CLIError(str(e)) from None
    decode_ep = None  # disaggregated: the decode workers' expert-parallel groups
    if args.prefill_workers or args.decode_workers:
        decode_ep, ep_config = _decode_ep_config(args, ep_config, engine_config), None
    _check_port_free(args.host, args.port)
    from deepinfer.wire.secret import ClusterSecretError, ensure_cluster_secret
    try:  # exported to the environment: every process started from here inherits it
        ensure_cluster_secret(args.cluster_secret_file)
    except ClusterSecretError as e:
        raise CLIError(str(e)) from None
    from deepinfer.multimodal.media_args import media_policy_from_args
    from deepinfer.multimodal.processor import vision_language_checkpoint
    from deepinfer.server.chat_options import chat_options_from_args
    try:
        from deepinfer.server.limit_args import limits_from_args
        limits = limits_from_args(args)
        media_policy = media_policy_from_args(args)
        chat_options = chat_options_from_args(args)
    except ValueError as e:
        raise CLIError(str(e)) from None
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                          max_waiting_requests=args.max_waiting_requests or None,
                          limits=limits, enable_admin_api=args.enable_admin_api,
                          admin_api_key=args.admin_api_key,
                          enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                          metrics_need_api_key=args.metrics_need_api_key,
                          log_level=args.uvicorn_log_level,
                          engine_restart=EngineRestartPolicy(args.max_engine_restarts),
                          engine_loop_stall_timeout_s=args.loop_stall_timeout,
                          mm_model_path=vision_language_checkpoint(engine_config.model),
                          media_policy=media_policy, chat_options=chat_options)
    if args.demo:
        def on_ready(host: str, port: int) -> None:
            try:
                _demo(args.api_key, args.demo_question, host, port)
            except Exception as e:  # the server keeps serving even if the demo fails
                print(f"demo request failed: {e}", file=sys.stderr, flush=True)
    else:
        on_ready = _announce
    try:
        from deepinfer.clients.factory import client_from_args
        try:
            if ep_config is not None:  # rank groups behind a routing front: local, or on Ray
                client = client_from_args(args, engine_config, ep_config=ep_config,
                                          log_level=args.log_level,
                                          restart_policy=config.engine_restart)
            else:  # P/D workers when their counts are given, else one engine process
                client = client_from_args(
                    args, engine_config, decode_ep=decode_ep, log_level=config.log_level,
                    restart_policy=config.engine_restart,
                    loop_stall_timeout_s=config.engine_loop_stall_timeout_s)
        except ValueError as e:  # bad cluster flags: the CLI's one-line exit 2
            raise CLIError(str(e)) from None
        asyncio.run(run_server(config, client, on_ready=on_ready))
    except EngineDeadError as e:
        raise CLIError(str(e).strip().splitlines()[-1]) from None
    except KeyboardInterrupt:  # Ctrl-C is the normal way to stop a server
        pass
    return 0
