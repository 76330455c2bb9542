"""Free TCP ports on 127.0.0.1, for the servers tests and benchmarks start.

Other engineers run tests and labs on the same machine at the same time, so
nothing may assume a fixed port is free: single servers take a port the
kernel hands out, a lab takes a base port all of whose node ports are free.
Under pytest-xdist each worker draws lab bases from its own slice of the
range, so two workers never probe the same ports while one of them is still
starting the daemons that will bind them.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachefs.lab.cluster import LabConfig


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (all held open together, so no two are the same)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def free_lab_base(config: LabConfig, offsets: tuple[int, ...] = (0,)) -> int:
    """A base port for ``config`` whose every node port (and metrics port) is free now;
    with ``offsets``, also every node port plus each offset (a benchmark's relays).

    Bases are drawn below the kernel's ephemeral range (32768 and up on
    Linux), so a port handed out for an outgoing connection cannot land on a
    lab's node a moment after this check.
    """
    from cachefs.lab.cluster import Lab

    low, high = _base_range()
    candidates = list(range(low, high, 10))
    random.shuffle(candidates)
    for base in candidates:
        lab = Lab(dataclasses.replace(config, base_port=base, nodes=[], netns=""))
        ports = [port for node in lab.nodes for port in (node.metrics_port, *(node.port + o for o in offsets))]
        if _all_free([port for port in (*ports, lab.config.mount_metrics_port, lab.config.prometheus_port) if port]):
            return base
    raise RuntimeError(f"no base port in {low}-{high} has all of a lab's ports free")


LAB_SPAN = 1500  # a lab's ports lie within base .. base + LAB_SPAN (metrics +1000, mount +1300, prometheus +1400)


def _base_range(low: int = 20000, high: int = 31000) -> tuple[int, int]:
    """The bases this process may use: all of them, or this xdist worker's slice."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return low, high
    width = (high - low) // count
    start = low + int(worker[2:]) % count * width
    return start, start + width - LAB_SPAN


def _all_free(ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True
