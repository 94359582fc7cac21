"""OpenAI-style API errors: an exception the serving code raises, and its JSON response."""
from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from deepinfer.server.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An error returned to the client as `{"error": {message, type, param, code}}`."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers  # e.g. Retry-After on a 429
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError) -> APIError:
    """Turn pydantic's error list into one 400 naming the first offending parameter."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"Malformed JSON body: {first.get('msg')}", code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if not isinstance(part, int)]
    # Unions add the member type to the location ("prompt.str"); keep the field path only.
    param = loc[0] if loc else None
    message = f"{'.'.join(loc) or 'body'}: {first.get('msg')}"
    if first.get("type") == "missing":
        return bad_request(message, param=param, code="missing_required_parameter")
    return bad_request(message, param=param, code="invalid_value")
