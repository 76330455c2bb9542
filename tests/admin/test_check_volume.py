"""``check_volume``: the leader runs the metadata invariants on its applied state
(the first half of ``cachefs fsck``), on the in-process metanode."""

from __future__ import annotations

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
