"""ASGI guards in front of the routes: the request-body cap (413) and the cap on requests in
flight (429 with Retry-After).

Pure ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection pass through
untouched. The body cap is enforced twice: a declared Content-Length over the cap is refused
before a byte is read, and the bytes actually received are counted (a chunked or lying
client), so a route never holds more than the cap in memory before parsing.
"""
from __future__ import annotations

from deepinfer.server.errors import APIError

# Paths that do work per request; /health and /metrics stay cheap and are never capped.
GUARDED_PREFIXES = ("/v1", "/admin")
RETRY_AFTER_S = 1


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body exceeds the limit of {limit} bytes "
                         "(--max-request-body-bytes)", code="request_too_large")


class BodySizeLimitMiddleware:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > self.max_bytes
            except ValueError:
                too_large = False  # the server's HTTP parser rejects it itself
            if too_large:
                await BodyTooLarge(self.max_bytes).to_response()(scope, receive, send)
                return
        num_received = 0

        async def limited_receive():
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)  # the route's handler answers 413
            return message

        await self.app(scope, limited_receive, send)


class ConcurrencyLimitMiddleware:
    """At most `limit` guarded requests in flight (a stream counts until its last byte);
    more get 429 at once, before their body is read."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.num_in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIXES):
            await self.app(scope, receive, send)
            return
        if self.num_in_flight >= self.limit:
            error = APIError(429, f"Too many concurrent requests (limit {self.limit}); retry "
                             "later", type="rate_limit_error", code="rate_limit_exceeded",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
            await error.to_response()(scope, receive, send)
            return
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1
