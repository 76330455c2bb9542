"""Free TCP ports on 127.0.0.1, for the servers tests and benchmarks start.

Other engineers run tests and labs on the same machine at the same time, so
nothing may assume a fixed port is free: single servers take ports that are
free now from just below the kernel's ephemeral range (``free_ports``), a
lab takes a base port, lower still, all of whose node ports are free.
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
    """``n`` distinct ports free now (all held open together, so no two are the same).

    Drawn from below the kernel's ephemeral range (``SINGLE_LOW`` up to its
    start; under xdist, this worker's slice of that), not handed out by the
    kernel: an ephemeral port is free only until some process's outgoing
    connection takes it, and a server that connects to itself before it
    listens (SeaweedFS's filer dialled its master first) then lost its own
    port ("bind: address already in use", six tests of a CI run). Where
    that range is too small, the kernel picks.
    """
    low, high = _single_range()
    if high - low < 4 * n:
        return _kernel_ports(n)
    held: list[socket.socket] = []
    try:
        for port in random.sample(range(low, high), high - low):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
            if len(held) == n:
                return [s.getsockname()[1] for s in held]
        raise RuntimeError(f"fewer than {n} ports free in {low}-{high}")
    finally:
        for s in held:
            s.close()


def _kernel_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


LAB_LOW = 20000  # labs' bases: from here to SINGLE_LOW, less a lab's span
SINGLE_LOW = 31000  # single servers' ports: from here to the ephemeral range


def _worker_slice(low: int, high: int) -> tuple[int, int]:
    """``[low, high)``, or under pytest-xdist this worker's slice of it: two
    workers never probe the same ports while one is still starting the
    servers that will bind them."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1 or high <= low:
        return low, high
    width = (high - low) // count
    start = low + int(worker[2:]) % count * width
    return start, start + width


def _single_range() -> tuple[int, int]:
    """The ports ``free_ports`` may hand out here: below the ephemeral range, this xdist worker's slice."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768
    return _worker_slice(SINGLE_LOW, high)


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


def _base_range() -> tuple[int, int]:
    """The bases this process may use (this xdist worker's slice), so that
    every port of a lab stays below ``SINGLE_LOW``."""
    start, end = _worker_slice(LAB_LOW, SINGLE_LOW)
    return start, end - LAB_SPAN


def _all_free(ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True
