"""Free TCP ports on 127.0.0.1, for the servers tests and benchmarks start.

Other engineers run tests and labs on the same machine at the same time, so
nothing may assume a fixed port is free: single servers take a port the
kernel hands out, a lab takes a base port all of whose node ports are free.
"""

from __future__ import annotations

import dataclasses
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

    candidates = list(range(20000, 31000, 10))
    random.shuffle(candidates)
    for base in candidates:
        lab = Lab(dataclasses.replace(config, base_port=base, nodes=[], netns=""))
        ports = [port for node in lab.nodes for port in (node.metrics_port, *(node.port + o for o in offsets))]
        if _all_free([port for port in (*ports, lab.config.mount_metrics_port, lab.config.prometheus_port) if port]):
            return base
    raise RuntimeError("no base port in 20000-31000 has all of a lab's ports free")


def _all_free(ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True
