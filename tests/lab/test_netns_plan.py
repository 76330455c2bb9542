"""The pure part of cachefs/lab/netns.py: names, addresses and targets of a lab network."""

from __future__ import annotations

import ipaddress

import pytest

from cachefs.lab import netns
from cachefs.lab.cluster import Lab, LabConfig


def lab_network(tmp_path) -> tuple[Lab, netns.Network]:
    lab = Lab(LabConfig(root=str(tmp_path), netns=netns.DEFAULT_SUBNET))
    return lab, netns.Network.plan(tmp_path, netns.DEFAULT_SUBNET, [(n.name, n.zone) for n in lab.nodes])


def test_every_name_fits_the_kernel_and_carries_the_prefix(tmp_path):
    _, net = lab_network(tmp_path)
    names = [net.bridge] + [ep.veth for ep in net.endpoints]
    assert all(len(n) <= 15 for n in names), "interface names are limited to 15 bytes (IFNAMSIZ - 1)"
    assert all(n.startswith(net.prefix + "-") for n in names + [ep.ns for ep in net.endpoints])
    assert len(set(names)) == len(names) and len({ep.ns for ep in net.endpoints}) == len(net.endpoints)
    other = netns.Network.plan(tmp_path, netns.DEFAULT_SUBNET, [])
    assert other.prefix != net.prefix


def test_addresses_match_the_lab_and_stay_private(tmp_path):
    lab, net = lab_network(tmp_path)
    subnet = ipaddress.ip_network(netns.DEFAULT_SUBNET)
    ips = [ipaddress.ip_address(ep.ip) for ep in net.endpoints]
    assert all(ip in subnet and ip.is_private for ip in ips) and len(set(ips)) == len(ips)
    assert [n.addr.rsplit(":", 1)[0] for n in lab.nodes] == [ep.ip for ep in net.endpoints[1:]]
    assert len({n.port for n in lab.nodes}) == len(lab.nodes)
    with pytest.raises(netns.BadArgument, match="private"):
        netns.node_ip("8.8.8.0/24", 1)
    with pytest.raises(netns.BadArgument, match="subnet 'ten'"):
        netns.node_ip("ten", 1)
    with pytest.raises(netns.BadArgument, match="too small"):
        netns.node_ip("10.1.2.0/29", 1)


def test_targets(tmp_path):
    _, net = lab_network(tmp_path)
    assert [ep.name for ep in net.targets("z2")] == ["meta2", "data2", "data5", "cache2", "cache5"]
    assert [ep.name for ep in net.targets("data3")] == ["data3"]
    assert netns.CLIENT not in [ep.name for ep in net.targets(netns.CLIENT_ZONE)]
    with pytest.raises(netns.BadArgument, match="neither a lab node nor a zone"):
        net.targets("z9")
    with pytest.raises(netns.BadArgument, match="link or loss"):
        net.cut("z1", how="unplug")
    with pytest.raises(netns.BadArgument, match="duration"):
        net.set_latency("z1", "fast")
    assert net.targets(netns.ALL) == net.endpoints  # the client's link too
    with pytest.raises(netns.BadArgument, match="from 0 to 100"):
        net.set_loss(101, "z1")


def test_loss_rules_from_state(tmp_path):
    """Each lossy endpoint's link drops both ways; a loss cut is 100% (no draw); none: no rules."""
    _, net = lab_network(tmp_path)
    assert net._loss_rules() == []
    net.loss = {"data1": 5.0, "client": 0.25}
    net.cut_links = {"data2": "loss", "data3": "link"}
    h = {name: net.endpoint(name).veth for name in ("client", "data1", "data2")}
    assert net._loss_rules() == [
        f'iifname "{h["client"]}" numgen random mod 10000 < 25 counter drop',
        f'oifname "{h["client"]}" numgen random mod 10000 < 25 counter drop',
        f'iifname "{h["data1"]}" numgen random mod 10000 < 500 counter drop',
        f'oifname "{h["data1"]}" numgen random mod 10000 < 500 counter drop',
        f'iifname "{h["data2"]}" counter drop',
        f'oifname "{h["data2"]}" counter drop',
    ]
    assert net.loss_of("data2") == 100.0 and net.loss_of("data3") == 0.0


def test_state_round_trip_and_foreign_prefix_refused(tmp_path):
    _, net = lab_network(tmp_path)
    net.cut_links["data1"] = "link"
    net.save()
    assert netns.Network.load(tmp_path) == net
    net.prefix = "eth"  # a state file that would name someone else's interfaces
    net.save()
    with pytest.raises(netns.NetnsError, match="not a lab prefix"):
        netns.Network.load(tmp_path)


def test_lab_status_link_column(tmp_path):
    lab, net = lab_network(tmp_path)
    net.cut_links = {"data1": "link", "data2": "loss"}
    net.loss = {"data3": 5.0}
    net.save()
    assert [lab._link_state(n) for n in ("data1", "data2", "data3", "data4")] == [
        "cut", "loss 100%", "loss 5%", "up"]
