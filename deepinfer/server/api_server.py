"""The OpenAI-compatible HTTP front: FastAPI routes over an `EngineClient`, served by uvicorn.

Routes: GET /health, GET /metrics, GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, and (disaggregated) POST /admin/scale, GET /admin/workers
(`admin_routes`). Every error is an OpenAI-style body (see `errors.APIError`).
A client that disconnects (streaming or not) cancels its handler, which aborts its engine
request and so frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.core.restart_policy import RestartPolicy
from deepinfer.server.admission import AdmissionGate
from deepinfer.server.errors import APIError, from_validation_error
from deepinfer.server.http_guards import BodySizeLimitMiddleware, ConcurrencyLimitMiddleware
from deepinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from deepinfer.server.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
    ErrorResponse, ModelCard, ModelList,
)
from deepinfer.server.prepare_pool import PreparePool
from deepinfer.server.request_limits import (RequestLimits, check_request,
                                              default_max_connections)
from deepinfer.server.request_schema import with_served_model
from deepinfer.server.serving_chat import OpenAIServingChat
from deepinfer.server.serving_completion import OpenAIServingCompletion
from deepinfer.server.serving_tokenize import (
    DetokenizeRequest, DetokenizeResponse, OpenAIServingTokenize, TokenizeCompletionRequest,
    TokenizeResponse, parse_tokenize_body)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting_requests: int | None = None
    enable_admin_api: bool = False  # /admin/* (scale, workers); needs admin_api_key or api_key
    admin_api_key: str | None = None  # /admin/* need this key instead of api_key
    metrics_need_api_key: bool = False  # /metrics behind api_key as well
    # usage.prompt_tokens_details.cached_tokens (off: it is a prefix-cache oracle across tenants)
    enable_prompt_tokens_details: bool = False
    limits: RequestLimits = RequestLimits()  # per-request caps, body size, requests in flight
    log_level: str = "warning"
    engine_restart: RestartPolicy = RestartPolicy()  # colocated engine only
    engine_loop_stall_timeout_s: float | None = 30.0  # colocated: a silent engine is killed
    # A vision-language checkpoint: chat image parts go through its processor under this policy.
    mm_model_path: str | None = None
    media_policy: Any = None  # deepinfer.multimodal.image_input.MediaPolicy; None = defaults
    chat_options: Any = None  # deepinfer.server.chat_options.ChatOptions; None = defaults


class _ClientDisconnected(Exception):
    pass


async def _until_disconnect(raw_request: Request, coro):
    """Await `coro`, cancelling it if the client goes away first (frees its engine request)."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _ClientDisconnected()


def _documented_body(model) -> dict:
    """OpenAPI for a JSON body that the route parses itself (so that bad input gets an
    OpenAI-shaped 400, not FastAPI's 422); the schema is added by `_openapi_with_bodies`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


# `stream: true` answers are server-sent events (data: <chunk JSON> lines, then data: [DONE]);
# the schema is one event's, as an event-stream reader hands it over.
_EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string",
                            "description": "one chunk as JSON; the last event is [DONE]"},
                   "event": {"type": "string"}}}}}


def _error_responses() -> dict:
    doc = {400: "Invalid request: a body the schema forbids, or one breaking a rule it cannot "
                "state: the prompt (plus max_tokens) over the model's context, fields that "
                "need or exclude each other (stream_options and stream, best_of and n, "
                "min_tokens and max_tokens, ...), a feature the model or deployment lacks "
                "(FIM tokens, a tool parser, prompt log-probs), or a structured-output spec "
                "or tool schema its compiler refuses",
           401: "Missing or wrong API key",
           404: "The model named in the request is not served here",
           413: "Request body over --max-request-body-bytes",
           429: "Too many waiting or concurrent requests (see Retry-After)",
           500: "The engine failed during the request",
           503: "The engine is restarting"}
    return {code: {"model": ErrorResponse, "description": text} for code, text in doc.items()}


def _openapi_with_bodies(app: FastAPI, body_models: list, vocab_size: int) -> dict:
    """FastAPI's schema plus the request models named by `_documented_body`, with the served
    model's token id range."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in body_models:
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        app.openapi_schema = with_served_model(schema, vocab_size)
    return app.openapi_schema


class ApiKeyMiddleware:
    """401 for requests under `prefixes` (/v1, and /admin unless it has its own key) without
    `Authorization: Bearer <api_key>`. Pure ASGI (not BaseHTTPMiddleware) so streaming and
    disconnect detection pass through untouched."""

    def __init__(self, app, api_key: str, prefixes: tuple[str, ...] = ("/v1", "/admin")) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.prefixes = prefixes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes):
            headers = dict(scope.get("headers") or [])
            header = headers.get(b"authorization", b"")
            token = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                response = APIError(401, "Invalid or missing API key",
                                    type="authentication_error", code="invalid_api_key")
                await response.to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(client, config: ServerConfig) -> FastAPI:
    """The app over `client`, an already started `clients.protocol.EngineClient`."""
    served_names = [client.model_name]  # EngineConfig.served_model_name, else the model's
    metrics = ServerMetrics(served_names[0], lambda: client.stats)
    if hasattr(client, "register_metrics"):  # engine restarts; per-worker cluster metrics
        client.register_metrics(metrics.registry)
    gate = AdmissionGate(config.max_waiting_requests, lambda: client.num_waiting_requests)
    completion = OpenAIServingCompletion(client, metrics, served_names, gate)
    chat = OpenAIServingChat(client, metrics, served_names, gate)
    if config.chat_options is not None:
        chat.configure(config.chat_options)
    if config.mm_model_path:
        from deepinfer.multimodal.image_input import MediaPolicy
        from deepinfer.multimodal.processor import MultiModalProcessor
        policy = config.media_policy or MediaPolicy()
        chat.enable_images(MultiModalProcessor.from_pretrained(config.mm_model_path), policy)
    tokenize = OpenAIServingTokenize(client, metrics, served_names, gate, chat=chat)
    completion.prepare_pool = chat.prepare_pool = tokenize.prepare_pool = PreparePool()
    completion.prompt_tokens_details = chat.prompt_tokens_details = \
        config.enable_prompt_tokens_details
    limits = config.limits if not config.mm_model_path else dataclasses.replace(
        config.limits, max_images_per_request=policy.limit_per_prompt)
    app = FastAPI(title="DeepInfer OpenAI-compatible API")

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    if limits.max_concurrent_requests is not None:
        app.add_middleware(ConcurrencyLimitMiddleware, limit=limits.max_concurrent_requests)
    if config.api_key:
        prefixes = ("/v1", "/tokenize", "/detokenize") \
            + (() if config.admin_api_key else ("/admin",)) \
            + (("/metrics",) if config.metrics_need_api_key else ())
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, prefixes=prefixes)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError):
        return exc.to_response()

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception):
        logger.exception("unhandled error: %s", exc)
        return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}",
                        type="internal_error").to_response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # Starlette's own headers survive (a 405's Allow names the methods the path takes).
        return APIError(exc.status_code, str(exc.detail), type=kind,
                        headers=dict(exc.headers) if exc.headers else None).to_response()

    @app.get("/health", responses={
        200: {"description": "Serving", "content": {"application/json": {
            "example": {"status": "ok"}}}},
        503: {"description": "The engine is down, restarting or its loop is stalled",
              "content": {"application/json": {"example": {"status": "unavailable"}}}}})
    async def health() -> JSONResponse:  # 503 while the engine is down or restarting
        healthy = client.is_healthy
        return JSONResponse({"status": "ok" if healthy else "unavailable"},
                            status_code=200 if healthy else 503)

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition", "content": {CONTENT_TYPE: {}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=client.model_name,
                                         max_model_len=client.max_model_len)
                               for name in served_names])

    async def serve(raw_request: Request, request_cls, serving) -> Response:
        try:
            request = request_cls.model_validate_json(await raw_request.body())
        except ValidationError as e:
            return from_validation_error(e).to_response()
        check_request(request, limits)  # before any tokenizing, fetching or engine work
        try:
            result = await _until_disconnect(raw_request, serving.create(request))
        except _ClientDisconnected:
            return Response(status_code=499)
        if request.stream:
            return StreamingResponse(result, media_type="text/event-stream")
        return JSONResponse(result.model_dump())

    @app.post("/v1/completions", openapi_extra=_documented_body(CompletionRequest),
              responses={200: {"model": CompletionResponse, "description": "The completion "
                               "(a text/event-stream of such chunks when `stream`)",
                               "content": _EVENT_STREAM},
                         **_error_responses()})
    async def completions(raw_request: Request) -> Response:
        return await serve(raw_request, CompletionRequest, completion)

    @app.post("/v1/chat/completions", openapi_extra=_documented_body(ChatCompletionRequest),
              responses={200: {"model": ChatCompletionResponse, "description": "The chat "
                               "completion (a text/event-stream of chunks when `stream`)",
                               "content": _EVENT_STREAM},
                         **_error_responses()})
    async def chat_completions(raw_request: Request) -> Response:
        return await serve(raw_request, ChatCompletionRequest, chat)

    @app.post("/tokenize", openapi_extra=_documented_body(TokenizeCompletionRequest),
              responses={200: {"model": TokenizeResponse}, **_error_responses()})
    async def tokenize_route(raw_request: Request) -> Response:
        request = parse_tokenize_body(await raw_request.body())
        return JSONResponse((await tokenize.tokenize(request)).model_dump(exclude_none=True))

    @app.post("/detokenize", openapi_extra=_documented_body(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse}, **_error_responses()})
    async def detokenize_route(raw_request: Request) -> Response:
        try:
            request = DetokenizeRequest.model_validate_json(await raw_request.body())
        except ValidationError as e:
            return from_validation_error(e).to_response()
        return JSONResponse((await tokenize.detokenize(request)).model_dump())

    from deepinfer.server.admin_routes import add_admin_off_routes, add_admin_routes
    if config.enable_admin_api:  # POST /admin/scale, GET /admin/workers
        add_admin_routes(app, client, config.api_key, config.admin_api_key)
    else:
        add_admin_off_routes(app)

    app.openapi = lambda: _openapi_with_bodies(app, [CompletionRequest, ChatCompletionRequest,
                                                     TokenizeCompletionRequest, DetokenizeRequest],
                                              client.vocab_size)
    return app


def uvicorn_options(config: ServerConfig) -> dict:
    """uvicorn.Config's keywords: idle keep-alive connections close after 30 s, and past the
    connection cap a new request gets uvicorn's 503."""
    limit = config.limits.max_connections or default_max_connections()
    return {"host": config.host, "port": config.port, "log_level": config.log_level.lower(),
            "timeout_keep_alive": 30, "limit_concurrency": limit}


async def run_server(config: ServerConfig, client, on_ready=None) -> None:
    """Start `client` (unstarted, from `clients.factory.make_client`), then serve HTTP until
    uvicorn exits (Ctrl-C / SIGTERM). `on_ready(host, port)` (optional, sync) is called once
    the port accepts connections."""
    import uvicorn

    try:
        await client.start()
        app = build_app(client, config)
        server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(config)))
        serve_task = asyncio.create_task(server.serve())
        if on_ready is not None:
            while not server.started and not serve_task.done():
                await asyncio.sleep(0.05)
            if server.started:
                await asyncio.to_thread(on_ready, config.host, config.port)
        await serve_task
    finally:
        await client.shutdown()
