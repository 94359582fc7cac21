"""Per-request cost caps, checked right after the body is parsed and before any tokenizing,
templating, image fetching or engine work.

Each option below costs work for every tenant (a stop string is matched after every token, a
bad word and a logit-bias entry are applied at every sampling step, a prompt times `n` is that
many sequences in the batch), so one request must not be able to ask for an unbounded amount.
A refusal is a 400 naming the field; the body-size cap (413) and the concurrency cap (429) are
ASGI middlewares in `http_guards`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.server.errors import bad_request

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (`deepinfer serve` flags in the "security" group)."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_concurrent_requests: int | None = None  # HTTP requests in flight; None: no cap
    max_connections: int | None = None  # open HTTP connections; None: default_max_connections()
    max_sequences_per_request: int = 1024  # prompts x n
    max_messages: int = 1024
    max_content_parts: int = 1024  # over all messages
    max_stop_strings: int = 64  # also the cap on bad_words
    max_stop_string_chars: int = 1024
    max_token_id_list: int = 4096  # stop_token_ids
    max_logit_bias: int = 1024
    max_images_per_request: int | None = None  # --limit-mm-per-prompt, counted before fetching
    max_json_depth: int = 32  # nesting of free-form values (messages, tools, unknown fields)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is not None and value < 1 and name != "max_images_per_request":
                raise ValueError(f"{name} must be at least 1, got {value}")


def num_prompts(prompt: Any) -> int:
    """How many prompts a completions `prompt` holds (a string or one list of ids is one)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def default_max_connections() -> int:
    """Open connections uvicorn serves before it answers 503: half the process's file
    descriptors (the rest stay for the engine's sockets, model files and logs), so a flood of
    idle connections meets a 503 instead of taking every descriptor."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 16384
    return max(32, min(16384, soft // 2))


def check_request(request, limits: RequestLimits) -> None:
    """400 naming the first field over its cap; `request` is a parsed Completion or Chat
    request (both share the sampling fields)."""
    prompt = getattr(request, "prompt", None)
    sequences = (num_prompts(prompt) if prompt is not None else 1) * request.n
    if sequences > limits.max_sequences_per_request:
        raise _over("n" if prompt is None else "prompt",
                    f"prompts x n = {sequences} sequences exceeds the limit of "
                    f"{limits.max_sequences_per_request} per request")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    _check_strings("stop", stop, limits)
    _check_strings("bad_words", request.bad_words or [], limits)
    if len(request.stop_token_ids or ()) > limits.max_token_id_list:
        raise _over("stop_token_ids", f"stop_token_ids has more than {limits.max_token_id_list} "
                    "entries")
    if len(request.logit_bias or ()) > limits.max_logit_bias:
        raise _over("logit_bias", f"logit_bias has more than {limits.max_logit_bias} entries")
    messages = getattr(request, "messages", None)
    if messages is not None:
        _check_messages(messages, limits)
    for name in ("messages", "tools", "response_format"):
        _check_depth(name, getattr(request, name, None), limits.max_json_depth)
    for name, value in (request.model_extra or {}).items():
        _check_depth(name, value, limits.max_json_depth)


def _check_strings(param: str, values: list[str], limits: RequestLimits) -> None:
    if len(values) > limits.max_stop_strings:
        raise _over(param, f"{param} has {len(values)} entries; at most "
                    f"{limits.max_stop_strings} are allowed")
    for value in values:
        if len(value) > limits.max_stop_string_chars:
            raise _over(param, f"{param} entries may be at most {limits.max_stop_string_chars} "
                        "characters long")


def _check_messages(messages: list, limits: RequestLimits) -> None:
    if len(messages) > limits.max_messages:
        raise _over("messages", f"{len(messages)} messages exceed the limit of "
                    f"{limits.max_messages}")
    num_parts = num_images = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            num_parts += len(content)
            num_images += sum(1 for p in content
                              if isinstance(p, dict) and p.get("type") == "image_url")
    if num_parts > limits.max_content_parts:
        raise _over("messages", f"{num_parts} content parts exceed the limit of "
                    f"{limits.max_content_parts}")
    if limits.max_images_per_request is not None and num_images > limits.max_images_per_request:
        raise _over("messages", f"At most {limits.max_images_per_request} image(s) may be "
                    f"provided in one request, got {num_images} (set by --limit-mm-per-prompt)")


def _check_depth(param: str, value: Any, max_depth: int) -> None:
    """Iterative (a recursive walk is what a deep value would attack)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise _over(param, f"{param} is nested more than {max_depth} levels deep")
        stack.extend((child, depth + 1) for child in children)


def _over(param: str, message: str):
    return bad_request(message, param=param, code="limit_exceeded")
