"""Prometheus metrics shared by every daemon.

RPC metrics are recorded by the RPC server for every call, so each daemon gets
calls, errors, bytes and latency per method without code of its own; daemons
add their own counters (cache hits, shard repairs...) next to their code.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from prometheus_client import Counter, Histogram, start_http_server

log = logging.getLogger(__name__)

RPC_CALLS = Counter("cachefs_rpc_calls_total", "RPC calls served", ["service", "method", "code"])
RPC_LATENCY = Histogram(
    "cachefs_rpc_latency_seconds", "RPC handler latency", ["service", "method"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)
RPC_BYTES_IN = Counter("cachefs_rpc_payload_received_bytes_total", "Bulk payload bytes received", ["service", "method"])

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


# The port each kind serves /metrics on unless told otherwise (docs/config.md
# lists them with the options). Several daemons of one kind on one host (a
# lab, a datanode per disk, a mount per volume) give explicit ports; one that
# finds its default taken falls back to a free port and logs it.
DEFAULT_PORTS = {"metanode": 9560, "datanode": 9561, "cachenode": 9562, "mount": 9563, "repair": 9564}


def default_ports_text() -> str:
    """``9560 metanode, 9561 datanode, ...``: the defaults as every doc spells them
    (docs/config.md is generated with it; tests/core/test_default_ports.py holds
    the hand-written docs to it)."""
    return ", ".join(f"{port} {kind.replace('cachenode', 'cache node')}" for kind, port in DEFAULT_PORTS.items())


@dataclass(frozen=True)
class MetricsAddr:
    """Where /metrics is served; ``explicit``: the operator chose it (a bind
    failure is then an error, not a fallback)."""

    host: str
    port: int
    explicit: bool = True


def parse_addr(text: str, *, explicit: bool = True) -> MetricsAddr:
    """``PORT`` or ``HOST:PORT``; the host defaults to ``CACHEFS_METRICS_HOST``
    or 127.0.0.1: metrics stay private unless the operator publishes them
    (containers set 0.0.0.0)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host = os.environ.get("CACHEFS_METRICS_HOST", "127.0.0.1")
    if not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ValueError(f"{text!r} is not PORT or HOST:PORT (port 1-65535)")
    return MetricsAddr(host.strip("[]"), int(port), explicit)


def start_metrics(addr: MetricsAddr | None) -> int | None:
    """Serve /metrics at ``addr`` from a daemon thread (None: off); returns the port.

    A default port already taken (another daemon of the kind on this host)
    falls back to a free one, logged; a port the operator chose must bind.
    """
    if addr is None:
        return None
    try:
        server, _ = start_http_server(addr.port, addr=addr.host)
    except OSError as exc:
        if addr.explicit:
            raise OSError(exc.errno, f"cannot serve metrics on {addr.host}:{addr.port}: {exc.strerror}") from None
        server, _ = start_http_server(0, addr=addr.host)
        log.warning("metrics: default port %d is taken (%s); serving on %d instead",
                    addr.port, exc.strerror, server.server_port)
    port = server.server_port
    log.info("metrics on http://%s:%d/metrics", addr.host, port)
    return port
