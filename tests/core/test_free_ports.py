"""free_ports hands out ports below the kernel's ephemeral range, so no
outgoing connection (a server dialling itself before it listens) can take
one between the check and the bind."""

from __future__ import annotations

import socket

from cachefs.testing.ports import LAB_SPAN, SINGLE_LOW, _base_range, _single_range, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    low, high = _single_range()
    ports = free_ports(11)
    assert len(set(ports)) == 11
    assert all(low <= p < high <= ephemeral for p in ports)
    socks = [socket.socket() for _ in ports]
    try:
        for s, port in zip(socks, ports, strict=True):
            s.bind(("127.0.0.1", port))
    finally:
        for s in socks:
            s.close()


def test_every_port_of_a_lab_lies_below_the_single_servers_ports() -> None:
    """With or without xdist: a lab at the highest base still ends below
    where ``free_ports`` starts (it ran past it without xdist before)."""
    low, high = _base_range()
    assert low < high and high + LAB_SPAN <= SINGLE_LOW
