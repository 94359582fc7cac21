"""Admin routes of a disaggregated server: scale workers while serving, list them.

    POST /admin/scale    {"role": "decode", "count": 2, "wait": true}  -> what was added/removed
    GET  /admin/workers  -> each worker's role, state, requests and placement

With --admin-api-key they need that key (and --api-key alone does not open them); else with
--api-key they need that key (like /v1/*); with neither they answer only to this machine
(loopback), since they change what the server runs. Keys are compared in constant time."""
from __future__ import annotations

import hmac
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.server.errors import APIError, from_validation_error

LOOPBACK_HOSTS = {"127.0.0.1", "::1", "localhost"}
MAX_SCALE_COUNT = 1024


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode"]
    count: int = Field(ge=1, le=MAX_SCALE_COUNT)
    wait: bool = True  # until added workers serve and removed ones are drained


def bearer_token(raw_request: Request) -> bytes:
    header = raw_request.headers.get("authorization", "").encode()
    return header[7:] if header[:7].lower() == b"bearer " else b""


def add_admin_routes(app: FastAPI, client, api_key: str | None,
                     admin_api_key: str | None = None) -> None:
    def check_access(raw_request: Request) -> None:
        if admin_api_key:
            if not hmac.compare_digest(bearer_token(raw_request), admin_api_key.encode()):
                raise APIError(401, "Invalid or missing admin API key (--admin-api-key)",
                               type="authentication_error", code="invalid_api_key")
        elif not api_key and (raw_request.client is None
                            or raw_request.client.host not in LOOPBACK_HOSTS):
            raise APIError(403, "admin endpoints without --api-key answer only to this machine",
                           type="permission_error")
        if not hasattr(client, "scale"):
            raise APIError(501, "scaling needs disaggregated serving (--prefill-workers N "
                           "--decode-workers M)", type="not_implemented_error")

    @app.post("/admin/scale")
    async def scale(raw_request: Request) -> JSONResponse:
        check_access(raw_request)
        try:
            request = ScaleRequest.model_validate_json(await raw_request.body())
        except ValidationError as e:
            return from_validation_error(e).to_response()
        try:
            result = await client.scale(request.role, request.count, wait=request.wait)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return JSONResponse({**result, "workers": client.describe_workers()})

    @app.get("/admin/workers")
    async def workers(raw_request: Request) -> JSONResponse:
        check_access(raw_request)
        return JSONResponse({"workers": client.describe_workers()})
