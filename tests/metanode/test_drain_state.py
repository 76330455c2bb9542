"""A draining datanode in the cluster map (``DrainNode``): out of the placement
groups, still in the map, kept in the snapshot, refused when too few would be left."""

from __future__ import annotations

import pytest

from cachefs import commands as C
from cachefs.backing.cluster import ClusterView
from cachefs.errors import CacheFSError
from cachefs.metanode.namespace import MetaState

from .nsdriver import Driver


def test_draining_takes_a_datanode_out_of_placement_and_back() -> None:
    ns = Driver()
    for i in range(4):
        ns.do(C.RegisterNode, "datanode", f"dn{i}", f"127.0.0.1:{9000 + i}", f"z{i % 3}", 1 << 30)
    ns.do(C.CreateVolume, "vol", "ec:2+1", "none", 4 << 20, 16)
    pgs = ns.state.cluster.pgs["vol"]
    assert any("dn3" in pg for pg in pgs)
    node = ns.do(C.DrainNode, "dn3")
    assert node["draining"] is True and node["state"] == "up"  # still read from
    after = ns.state.cluster.pgs["vol"]
    assert all("dn3" not in pg for pg in after)
    moved = sum(a != b for old, new in zip(pgs, after, strict=True) for a, b in zip(old, new, strict=True))
    assert moved == sum(pg.count("dn3") for pg in pgs)  # only its slots change
    view = ClusterView.from_map(ns.state.cluster.to_dict())
    assert view.datanodes["dn3"].draining and not view.datanodes["dn0"].draining

    restored = MetaState()
    restored.restore(ns.state.snapshot())
    assert restored.cluster.datanodes["dn3"].draining and restored.cluster.pgs == ns.state.cluster.pgs
    ns.do(C.RegisterNode, "datanode", "dn3", "127.0.0.1:9003", "z0", 1 << 30)  # a restart keeps it draining
    assert ns.state.cluster.datanodes["dn3"].draining

    with pytest.raises(CacheFSError, match=r"draining dn0 would leave 2 datanodes, and volume 'vol' \(ec:2\+1\) needs 3"):
        ns.do(C.DrainNode, "dn0")
    with pytest.raises(CacheFSError, match="no datanode nope"):
        ns.do(C.DrainNode, "nope")
    assert ns.do(C.DrainNode, "dn3", False)["draining"] is False
    assert any("dn3" in pg for pg in ns.state.cluster.pgs["vol"])
