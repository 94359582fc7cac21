"""The exception a step raises when it knows which requests caused it.

It lives in the core because the runtime (sampler, grammar masks) raises it and the engine's
step-fault isolation catches it: both sit above this layer.
"""
from __future__ import annotations


class RequestFault(Exception):
    """A step failed because of these requests (sequence ids) and no others."""

    def __init__(self, request_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
