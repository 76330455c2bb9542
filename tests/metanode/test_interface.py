"""The metadata interface is its classes: every client command and query is an
RPC method of its ``NAME``, decoded and checked from one wire list, and
every reply is decoded at the client by the class's ``REPLY``.

These run against the in-process metanode (real state machine, real service,
real RPC; one always-leading replica instead of Raft).
"""

from __future__ import annotations

import dataclasses
import errno

import pytest
import trio

from cachefs import commands as C
from cachefs import messages as M
from cachefs import queries as Q
from cachefs.errors import CacheFSError, IOFailure
from cachefs.metanode.service import MetaService
from cachefs.rpc import RpcPool, collect_methods
from cachefs.testing.metanode import local_metanode

VOL = "v"
# a value of the right type and one of a wrong type for each field annotation
RIGHT = {"int": 1, "str": "v", "bytes": b"n", "bool": False, "tuple[int, ...]": [1]}
WRONG = {"int": "x", "str": 5, "bytes": "text", "bool": 3, "tuple[int, ...]": ["x"]}


def _body(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in ("client_id", "seq", "now_ns")]


def _with_wrong(cls: type, wrong: dataclasses.Field) -> list[object]:
    """Fields of ``cls`` in order, all well typed but ``wrong``."""
    kinds = {f.name: str(f.type).removesuffix(" | None") for f in _body(cls)}
    return [(WRONG if f is wrong else RIGHT)[kinds[f.name]] for f in _body(cls)]


def test_every_class_is_one_rpc_method_and_nothing_else_is() -> None:
    served = set(collect_methods(MetaService(None)))  # type: ignore[arg-type]
    # restore_volume proposes RestoreVolume from a payload (a backup is over a header's 1 MiB);
    # metanode_add/remove propose Raft configurations, not state machine commands, and
    # meta_sessions reads the leader's soft state
    assert served == set(C.REQUESTS) | set(Q.QUERIES) | {
        "meta_status", "restore_volume", "metanode_add", "metanode_remove", "meta_sessions"}
    assert not set(C.REQUESTS) & set(Q.QUERIES)
    # the leader's own command is not a method: a client cannot purge orphans
    assert "PurgeOrphans" not in {cls.__name__ for cls in C.REQUESTS.values()}


async def test_a_wrong_type_in_any_field_is_einval_naming_it() -> None:
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.create_volume(VOL)
        mc = meta.client(pool)
        applied = meta.state.applied_index
        cases: list[tuple[str, list, str]] = []
        for name, cls in C.REQUESTS.items():
            for field in _body(cls):
                cases.append((name, ["c", 0, *_with_wrong(cls, field)], field.name))
        for name, cls in Q.QUERIES.items():
            for field in _body(cls):
                cases.append((name, _with_wrong(cls, field), field.name))
        for name, a, field_name in cases:
            with pytest.raises(CacheFSError) as info:
                await mc.call(name, {"a": a})
            assert info.value.errno == errno.EINVAL, (name, field_name, info.value)
            assert field_name in str(info.value), (name, field_name, info.value)
        for name in [*C.REQUESTS, *Q.QUERIES]:  # too many fields
            with pytest.raises(CacheFSError) as info:
                await mc.call(name, {"a": ["c", 0, *range(12)]})
            assert info.value.errno == errno.EINVAL, name
        assert meta.state.applied_index == applied  # nothing reached the log


async def test_replies_arrive_typed_and_a_retry_is_applied_once() -> None:
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.create_volume(VOL, block_size=64 * 1024)
        mc = meta.client(pool)
        d = await mc.mutate(C.Mkdir(VOL, 1, b"d", 0o755))
        assert isinstance(d, M.Attr) and d.is_dir
        # a request sent twice with one (client_id, seq), as MetaClient retries
        a = C.Mknod(VOL, d.ino, b"f", 0o100644).to_request("retrying-client", 7)
        first = M.Attr.from_wire(await mc.call("mknod", {"a": a}))
        assert M.Attr.from_wire(await mc.call("mknod", {"a": a})) == first
        rows = await mc.query(Q.ReadDir(VOL, d.ino))
        assert rows == [M.DirEntry(b"f", first, rows[0].cookie)]
        assert isinstance((await mc.query(Q.StatFs(VOL))), M.FsStats)
        assert (await mc.query(Q.GetUsage(VOL, d.ino))).inodes == 1
        first_slice = await mc.mutate(C.AllocSlices(2))
        await mc.mutate(C.WriteSlice(VOL, first.ino, 0, first_slice, 0, 10, 0, 1))
        (piece,) = await mc.query(Q.ReadChunk(VOL, first.ino, 0))
        assert (piece.id, piece.pos, piece.length) == (first_slice, 0, 10)
        info = await mc.mount_volume(VOL)
        assert isinstance(info, M.MountInfo) and info.root == 1
        assert await mc.query(Q.SessionHeartbeat(info.session, (first.ino,)))
        await mc.close_session(info.session)
        assert not await mc.query(Q.SessionHeartbeat(info.session))
        meta.check()


async def test_the_client_validates_before_sending() -> None:
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.create_volume(VOL)
        mc = meta.client(pool)
        with pytest.raises(CacheFSError) as info:
            await mc.mutate(C.Mknod(VOL, 1, b"a/b", 0o100644))
        assert info.value.errno == errno.EINVAL and not info.value.remote
        with pytest.raises(CacheFSError) as info:
            C.SetAttr(VOL, 2, size=1 << 60)  # past the largest file: truncate(2)'s EFBIG
        assert info.value.errno == errno.EFBIG
        with pytest.raises(ValueError):
            await mc.mutate(C.PurgeOrphans(VOL, (2,)))


@pytest.mark.parametrize(
    "decode, raw",
    [
        (M.Attr.from_wire, [1, 2, 3]),
        (M.Attr.from_wire, {"ino": 1}),
        (M.Attr.from_wire, [1] * 11 + ["x"]),
        (M.dir_entries, [[b"n", [1] * 12]]),
        (M.dir_entries, [["str-name", [1] * 12, 3]]),
        (M.slices, [[1, 0, -5, 0]]),
        (M.slices, [[1, 0, 10]]),
        (M.FsStats.from_wire, [0] * 10),
        (M.Usage.from_wire, [0, 0, "x", None]),
        (M.MountInfo.from_wire, [1, 2, {}]),
        (M.integer, True),
        (M.boolean, 1),
        (M.nothing, 0),
        (M.blob, "text"),
        (M.blobs, [b"a", "b"]),
        (M.mapping, []),
    ],
)
def test_a_malformed_reply_is_an_iofailure(decode, raw) -> None:
    with pytest.raises(IOFailure):
        decode(raw)


async def test_open_and_release_stay_soft_state() -> None:
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.create_volume(VOL)
        mc = meta.client(pool)
        f = await mc.mutate(C.Mknod(VOL, 1, b"f", 0o100644))
        session = (await mc.mount_volume(VOL)).session
        applied = meta.state.applied_index
        assert (await mc.query(Q.Open(VOL, f.ino, session))).ino == f.ino
        await mc.mutate(C.Unlink(VOL, 1, b"f"))  # stamped keep: the file is open
        assert meta.state.volumes[VOL].orphans == {f.ino}
        await mc.query(Q.Release(VOL, f.ino, session))
        with trio.fail_after(5):  # the last release lets the leader purge it
            while meta.state.volumes[VOL].orphans:
                await trio.sleep(0.01)
        # open and release added no log entry; unlink and the purge did
        assert meta.state.applied_index == applied + 2
        await mc.close_session(session)
        meta.check()
