"""Prometheus metrics shared by every daemon.

RPC metrics are recorded by the RPC server for every call, so each daemon gets
calls, errors, bytes and latency per method without code of its own; daemons
add their own counters (cache hits, shard repairs...) next to their code.
"""

from __future__ import annotations

import logging
import os

from prometheus_client import Counter, Histogram, start_http_server

log = logging.getLogger(__name__)

RPC_CALLS = Counter("cachefs_rpc_calls_total", "RPC calls served", ["service", "method", "code"])
RPC_LATENCY = Histogram(
    "cachefs_rpc_latency_seconds", "RPC handler latency", ["service", "method"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)
RPC_BYTES_IN = Counter("cachefs_rpc_payload_bytes_in_total", "Bulk payload bytes received", ["service", "method"])

RPC_REFUSED = Counter("cachefs_rpc_refused_connections_total",
                      "Connections dropped before or at authentication, by reason", ["service", "reason"])

# labels() takes a lock and builds a key; the hot path caches the children.
_children: dict[tuple[str, str, str], tuple[Counter, Histogram, Counter]] = {}


def observe_call(service: str, method: str, code: str, seconds: float, payload_in: int) -> None:
    key = (service, method, code)
    child = _children.get(key)
    if child is None:
        child = (RPC_CALLS.labels(service, method, code), RPC_LATENCY.labels(service, method),
                 RPC_BYTES_IN.labels(service, method))
        _children[key] = child
    child[0].inc()
    child[1].observe(seconds)
    if payload_in:
        child[2].inc(payload_in)


def refused_connection(service: str, reason: str) -> None:
    RPC_REFUSED.labels(service, reason).inc()


def start_metrics(port: int | None, host: str | None = None) -> None:
    """Serve /metrics on ``host:port`` from a daemon thread (None/0: off).

    The host defaults to ``CACHEFS_METRICS_HOST`` or 127.0.0.1: metrics stay
    private unless the operator publishes them (containers set 0.0.0.0).
    """
    if not port:
        return
    host = host or os.environ.get("CACHEFS_METRICS_HOST", "127.0.0.1")
    start_http_server(port, addr=host)
    log.info("metrics on http://%s:%d/metrics", host, port)
