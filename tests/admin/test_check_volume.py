"""``check_volume``: the leader runs the metadata invariants on its applied state
(the first half of ``cachefs fsck``), on the in-process metanode."""

from __future__ import annotations

import time

import pytest

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import NotFound
from cachefs.rpc import RpcPool
from cachefs.testing.metanode import local_metanode


async def test_check_volume_names_what_the_leaders_namespace_contradicts() -> None:
    async with local_metanode() as m, RpcPool(secret=None) as pool:
        await m.create_volume("v")
        await m.create_volume("w")
        mc = m.client(pool)
        d = await mc.mutate(C.Mkdir("v", 1, b"d", 0o755))
        assert await mc.query(Q.CheckVolume("v")) == []
        m.state.volumes["v"].used_bytes += 7  # the counter no longer matches a recount
        m.state.volumes["v"].inodes[d.ino].nlink = 3
        problems = await mc.query(Q.CheckVolume("v"))
        assert problems == ["v: dir 2 nlink 3, expected 2", "v: used_bytes 7, recount 0"]
        assert await mc.query(Q.CheckVolume("w")) == []  # one volume at a time
        with pytest.raises(NotFound, match="nope"):
            await mc.query(Q.CheckVolume("nope"))



def test_a_deleted_volume_is_a_tombstone_that_snapshots_keep_until_its_trash_is_empty() -> None:
    from cachefs.metanode import snapshot
    from cachefs.metanode.namespace import Failure, MetaState

    state = MetaState()
    now = time.time_ns()
    state.apply(1, C.CreateVolume("v", "replica:1", now_ns=now))
    f = state.apply(2, C.Mknod("v", 1, b"f", 0o100644, now_ns=now))
    first = state.apply(3, C.AllocSlices(1, now_ns=now))
    state.apply(4, C.WriteSlice("v", f.ino, 0, first, 0, 100, 0, now, now_ns=now))
    assert state.apply(5, C.DeleteVolume("v", now_ns=now)) == {"name": "v", "sessions_closed": 0,
                                                               "slices_trashed": 1}
    again = MetaState()
    snapshot.load(again, snapshot.dump(state))
    assert again.is_deleted("v") and "v" in again.cluster.volumes
    refused = again.apply(6, C.Mknod("v", 1, b"g", 0o100644, now_ns=now))
    assert isinstance(refused, Failure) and "deleted" in refused.message
    busy = again.apply(7, C.DropVolume("v", now_ns=now))
    assert isinstance(busy, Failure) and busy.code == "EBUSY"  # a trashed slice is left
    assert [e.slice_id for e in again.trash("v", 10)] == [first]
    assert again.apply(8, C.PurgeTrash("v", (first,), now_ns=now)) == 1
    again.apply(9, C.DropVolume("v", now_ns=now))
    assert "v" not in again.volumes and "v" not in again.cluster.volumes
