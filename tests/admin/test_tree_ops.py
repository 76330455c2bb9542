"""``cachefs tree clone`` and ``tree delete`` as the CLI drives them
(``cachefs/cli/tree.py``), against the real metanode service in process:
a clone that a quota stops names its partial copy, which ``tree delete``
removes; a delete of thousands of entries goes in leader steps of 1000 with
the progress reaching the whole tree."""

from __future__ import annotations

import errno

import pytest

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.cli.tree import clone_tree, delete_tree
from cachefs.errors import CacheFSError
from cachefs.metanode.namespace import Dir
from cachefs.rpc import RpcPool
from cachefs.testing.metanode import local_metanode


async def fill(mc, volume: str, parent: int, files: int, size: int) -> None:
    for i in range(files):
        attr = await mc.mutate(C.Mknod(volume, parent, b"f%d" % i, 0o100644, 0, 0, 0))
        sid = await mc.mutate(C.AllocSlices(1))
        await mc.mutate(C.WriteSlice("v", attr.ino, 0, sid, 0, size, 0, 1))


async def test_a_clone_stopped_by_a_quota_names_its_partial_copy_which_tree_delete_removes() -> None:
    async with local_metanode(housekeeping=0.1) as meta, RpcPool(secret=None) as pool:
        await meta.create_volume("v")
        mc = meta.client(pool)
        src = await mc.mutate(C.Mkdir("v", 1, b"src", 0o755))
        sub = await mc.mutate(C.Mkdir("v", src.ino, b"sub", 0o755))
        await fill(mc, "v", sub.ino, 5, 1000)
        limited = await mc.mutate(C.Mkdir("v", 1, b"limited", 0o755))
        await mc.mutate(C.SetQuota("v", limited.ino, 3000, None))
        seen: list[tuple[int, int]] = []
        with pytest.raises(CacheFSError) as info:
            await clone_tree(mc, "v", "/src", "/limited/copy", lambda done, total: seen.append((done, total)))
        assert info.value.errno == errno.EDQUOT
        partial = info.value.message.split("the partial copy is ")[1].split(":")[0]
        assert partial.startswith("/limited/.copy.cachefs-clone-"), info.value.message
        assert [e.name for e in await mc.query(Q.ReadDir("v", limited.ino, 0, 10))] == [partial.split("/")[-1].encode()]
        meta.check()

        out = await delete_tree(mc, "v", partial, lambda done, total: seen.append((done, total)), poll=0.05)
        assert out["done"] and out["inodes"] >= 2
        assert await mc.query(Q.ReadDir("v", limited.ino, 0, 10)) == []
        assert (await mc.query(Q.GetUsage("v", limited.ino)))[:2] == (0, 0)
        out = await clone_tree(mc, "v", "/src", "/copy")
        assert out["entries"] == 7 and out["bytes"] == 5000
        with pytest.raises(CacheFSError, match="/copy exists"):
            await clone_tree(mc, "v", "/src", "/copy")
        meta.check()


async def test_a_big_tree_is_deleted_in_leader_steps_with_progress_to_the_end() -> None:
    async with local_metanode(housekeeping=0.1) as meta, RpcPool(secret=None) as pool:
        await meta.create_volume("v")
        mc = meta.client(pool)
        top = await mc.mutate(C.Mkdir("v", 1, b"top", 0o755))
        vol = meta.state.volumes["v"]
        for d in range(3):  # 3000 files, straight into the state: 3000 RPCs would take a while
            sub = meta.state._create(vol, top.ino, b"d%d" % d, 0o040755, 0, 0, 1, Dir())
            for i in range(1000):
                meta.state._create(vol, sub.ino, b"f%d" % i, 0o100644, 0, 0, 1, None)
        seen: list[tuple[int, int]] = []
        index = meta.state.applied_index
        out = await delete_tree(mc, "v", "/top", lambda done, total: seen.append((done, total)), poll=0.01)
        assert out == {**out, "inodes": 3004, "done": True}
        assert seen[-1] == (3004, 3004) and [d for d, _t in seen] == sorted(d for d, _t in seen)
        assert meta.state.applied_index - index == 1 + 4  # DeleteTree, then 1000 inodes per PurgeTree
        assert set(vol.inodes) == {1} and not vol.doomed
        meta.check()
