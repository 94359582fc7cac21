"""The one check of router policy names, for every config that names them (serve's cluster
config, the simulator's cluster file). Pure."""
from __future__ import annotations

from deepinfer.routing.decode_router import DECODE_POLICIES
from deepinfer.routing.prefill_router import PREFILL_POLICIES


def check_router_names(prefill: str, decode: str) -> None:
    """ValueError naming the choices when either policy is unknown."""
    if prefill not in PREFILL_POLICIES:
        raise ValueError(f"unknown prefill router {prefill!r}; "
                         f"choose one of {sorted(PREFILL_POLICIES)}")
    if decode not in DECODE_POLICIES:
        raise ValueError(f"unknown decode router {decode!r}; "
                         f"choose one of {sorted(DECODE_POLICIES)}")
