"""Admin routes of a disaggregated server: scale workers while serving, list them.

    POST /admin/scale    {"role": "decode", "count": 2, "wait": true}  -> what was added/removed
    GET  /admin/workers  -> each worker's role, state, requests and placement

They exist only with --enable-admin-api (else /admin/* is a 404 saying so), and then always
behind a key: --admin-api-key if given (--api-key alone does not open them), else --api-key.
No caller is trusted by its source address: behind a same-host proxy every caller looks local.
Keys are compared in constant time."""
from __future__ import annotations

import hmac
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.server.errors import APIError, from_validation_error

MAX_SCALE_COUNT = 1024


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["prefill", "decode"]
    count: int = Field(ge=1, le=MAX_SCALE_COUNT)
    wait: bool = True  # until added workers serve and removed ones are drained


def bearer_token(raw_request: Request) -> bytes:
    header = raw_request.headers.get("authorization", "").encode()
    return header[7:] if header[:7].lower() == b"bearer " else b""


ADMIN_OFF = "the admin API is off: start the server with --enable-admin-api (and a key)"
ADMIN_NEEDS_KEY = "--enable-admin-api needs --admin-api-key or --api-key"


def add_admin_off_routes(app: FastAPI) -> None:
    """/admin/* without --enable-admin-api: a 404 that says how to turn it on."""
    @app.api_route("/admin/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
                   include_in_schema=False)
    async def admin_off(path: str) -> JSONResponse:
        return APIError(404, ADMIN_OFF, type="not_found_error").to_response()


def add_admin_routes(app: FastAPI, client, api_key: str | None,
                     admin_api_key: str | None = None) -> None:
    if not (admin_api_key or api_key):
        raise ValueError(ADMIN_NEEDS_KEY)

    def check_access(raw_request: Request) -> None:
        # --api-key holders without an admin key are checked by the app's ApiKeyMiddleware.
        if admin_api_key and not hmac.compare_digest(bearer_token(raw_request),
                                                     admin_api_key.encode()):
            raise APIError(401, "Invalid or missing admin API key (--admin-api-key)",
                           type="authentication_error", code="invalid_api_key")
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
