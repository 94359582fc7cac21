"""The Prometheus name prefix every process's metrics share; it lives low so that workers and
clients can name their metrics without importing the HTTP server."""
from __future__ import annotations

PREFIX = "deepinfer:"
