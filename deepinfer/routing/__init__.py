"""Pure routing policies over `WorkerLoad` snapshots (stdlib + numpy only; no torch)."""
from deepinfer.routing.decode_router import (DECODE_POLICIES, DEFAULT_DECODE_POLICY,
                                             DecodeRouter, build_decode_router)
from deepinfer.routing.prefill_cost import (CostModelPrefillCost, LinearQuadraticPrefillCost,
                                           PrefillCostFn)
from deepinfer.routing.prefill_router import (DEFAULT_PREFILL_POLICY, PREFILL_POLICIES,
                                              PrefillRouter, PrefixPlan, build_prefill_router)
from deepinfer.routing.prefix_locator import PrefixLocator, PrefixMatch
from deepinfer.routing.reservation_ledger import Reservation, ReservedLoad
from deepinfer.routing.router_base import NoWorkerAvailable, RequestTooLarge, Router
from deepinfer.routing.routing_request import RoutingRequest
from deepinfer.routing.worker_load import WORKER_ROLES, WorkerLoad

__all__ = [
    "CostModelPrefillCost", "DECODE_POLICIES", "DEFAULT_DECODE_POLICY", "DEFAULT_PREFILL_POLICY", "DecodeRouter",
    "LinearQuadraticPrefillCost", "NoWorkerAvailable", "PREFILL_POLICIES", "PrefillCostFn",
    "PrefillRouter", "PrefixLocator", "PrefixMatch", "PrefixPlan", "RequestTooLarge", "Reservation", "ReservedLoad", "Router", "RoutingRequest", "WORKER_ROLES",
    "WorkerLoad", "build_decode_router", "build_prefill_router",
]
