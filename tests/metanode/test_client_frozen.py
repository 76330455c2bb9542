"""MetaClient against 3 real metanodes, one of them SIGSTOPped (a frozen peer
answers nothing, like one behind a cut link): datanode-style heartbeats with
a 2 s deadline and metadata calls keep succeeding."""

from __future__ import annotations

import signal
from pathlib import Path

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError
from cachefs.metanode.client import MetaClient
from cachefs.rpc import RpcPool
from cachefs.testing.metacluster import MetaCluster


def _heartbeating_client(pool: RpcPool, addrs: list[str]) -> MetaClient:
    """What `cachefs datanode --heartbeat 1` makes (see cachefs/datanode.py)."""
    return MetaClient(pool, addrs, deadline=2.0, attempt_timeout=2.0)


async def test_one_frozen_metanode_costs_little(tmp_path: Path) -> None:
    meta = MetaCluster(tmp_path, n=3)
    meta.start_all()
    try:
        async with RpcPool(secret=None) as pool:
            leader = await meta.wait_leader(pool)
            admin = MetaClient(pool, meta.addrs, deadline=20.0)
            await admin.mutate(C.RegisterNode("datanode", "dn-t", "127.0.0.1:9", "a", 1 << 30))

            # A frozen follower listed first: a client that does not know the
            # leader yet still answers well within its 2 s deadline.
            follower = next(i for i in range(3) if i != leader)
            first = [meta.addrs[follower]] + [a for i, a in enumerate(meta.addrs) if i != follower]
            meta.procs[follower].send_signal(signal.SIGSTOP)
            try:
                for _ in range(3):
                    mc = _heartbeating_client(pool, first)
                    with trio.fail_after(2.5):
                        await mc.query(Q.NodeHeartbeat("datanode", "dn-t", 1))
                        await mc.query(Q.NodeHeartbeat("datanode", "dn-t", 2))
            finally:
                meta.procs[follower].send_signal(signal.SIGCONT)

            # The leader frozen, and first in the list: once the other two
            # elect a leader, every heartbeat and call succeeds again.
            first = [meta.addrs[leader]] + [a for i, a in enumerate(meta.addrs) if i != leader]
            mc = _heartbeating_client(pool, first)
            await mc.query(Q.NodeHeartbeat("datanode", "dn-t", 3))  # it knows the leader
            meta.procs[leader].send_signal(signal.SIGSTOP)
            try:
                outcomes: list[bool] = []
                start = trio.current_time()
                while trio.current_time() - start < 10 and (len(outcomes) < 8 or not all(outcomes[-8:])):
                    try:
                        await mc.query(Q.NodeHeartbeat("datanode", "dn-t", 4))
                        outcomes.append(True)
                    except CacheFSError:
                        outcomes.append(False)
                    await trio.sleep(0.2)
                assert outcomes[-8:] == [True] * 8, outcomes
                assert outcomes.count(False) <= 4, outcomes  # only while the others elect a leader
                with trio.fail_after(2.5):
                    cmap = await mc.query(Q.ClusterMap())
                    assert any(d["id"] == "dn-t" for d in cmap["datanodes"])
                    await mc.mutate(C.RegisterNode("datanode", "dn-u", "127.0.0.1:10", "b", 1 << 30))
            finally:
                meta.procs[leader].send_signal(signal.SIGCONT)
    finally:
        meta.stop_all()
