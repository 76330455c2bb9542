"""cachefs's FUSE client over an in-process metadata state machine.

``python -m tests.client.localfs MOUNTPOINT`` mounts the real client (fs,
reader, writer, session, mount code) with two parts swapped for in-process
ones: the metanode calls go to a real ``MetaState`` (the state machine the
metanodes replicate, applied directly, no Raft), and blocks live in a dict.
POSIX tests run against it in a second process in well under a second per
test; the same tests run against a mount of a real cluster when one can be
started (see conftest.py).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from typing import Any

import trio

from cachefs.client.mount import run_fs
from cachefs.client.session import Session
from cachefs.client.volume import ClientOptions
from cachefs.metanode import commands as C
from cachefs.metanode.invariants import check
from cachefs.metanode.namespace import Failure, MetaState
from cachefs.metanode.opentable import OpenTable
from cachefs.rpc import RpcPool
from cachefs.testing.backing import DictBacking
from cachefs.transport.tcp import TcpTransport

VOLUME = "vol"


class StateMeta:
    """The metanode RPC surface of docs/contracts.md over one MetaState."""

    def __init__(self, block_size: int) -> None:
        self.state = MetaState()
        self.client_id = "localfs"
        self._seq = itertools.count(1)
        self._index = itertools.count(1)
        self._do(C.CreateVolume, VOLUME, "replica:1", "none", block_size, 8)
        self.opens = OpenTable()  # the leader's soft state, as in the service

    def _purge(self) -> None:
        for name, vol in self.state.volumes.items():
            inos = [i for i in sorted(vol.orphans) if not self.opens.is_open(name, i)]
            if inos:
                self._do(C.PurgeOrphans, name, inos)

    def _do(self, cls: type[C.Command], *args: Any) -> Any:
        cmd = cls("localfs", next(self._seq), time.time_ns(), *args)
        result = self.state.apply(next(self._index), cmd.encode())
        if isinstance(result, Failure):
            raise result.error()
        return result

    async def mount_volume(self, volume: str, client_id: str) -> dict[str, Any]:
        info = self._do(C.MountVolume, volume)
        self.opens.known.add(info["session"])
        return info

    async def session_heartbeat(self, session: str, opens: list[int] | None = None) -> bool:
        return session in self.state.sessions

    async def close_session(self, volume: str, session: str) -> None:
        self._do(C.CloseSession, session)
        self.opens.end_session(session)
        self._purge()
        try:
            check(self.state)  # fsck-style invariants of everything the mount did
        except Exception:
            logging.getLogger("localfs").exception("metadata invariants violated")

    async def cluster_map(self) -> dict[str, Any]:
        return {"epoch": 1, "datanodes": [], "cachenodes": [], "volumes": {}, "pgs": {}}

    async def lookup(self, volume: str, parent: int, name: bytes) -> dict[str, Any]:
        return self.state.lookup(volume, parent, name)

    async def getattr(self, volume: str, ino: int) -> dict[str, Any]:
        return self.state.getattr(volume, ino)

    async def setattr(self, volume: str, ino: int, **ch: Any) -> dict[str, Any]:
        return self._do(
            C.SetAttr, volume, ino, ch.get("mode"), ch.get("uid"), ch.get("gid"), ch.get("size"),
            ch.get("atime_ns"), ch.get("mtime_ns"),
        )  # fmt: skip

    async def mknod(
        self, volume: str, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int
    ) -> Any:
        return self._do(C.Mknod, volume, parent, name, mode, rdev, uid, gid)

    async def mkdir(
        self, volume: str, parent: int, name: bytes, mode: int, uid: int, gid: int
    ) -> Any:
        return self._do(C.Mkdir, volume, parent, name, mode, uid, gid)

    async def symlink(
        self, volume: str, parent: int, name: bytes, target: bytes, uid: int, gid: int
    ) -> Any:
        return self._do(C.Symlink, volume, parent, name, target, uid, gid)

    async def link(self, volume: str, ino: int, new_parent: int, new_name: bytes) -> Any:
        return self._do(C.Link, volume, ino, new_parent, new_name)

    async def unlink(self, volume: str, parent: int, name: bytes) -> None:
        expect = self.state.predict_drop(volume, parent, name)
        self._do(C.Unlink, volume, parent, name, expect, self.opens.keep(self.state, volume, expect))
        self._purge()

    async def rmdir(self, volume: str, parent: int, name: bytes) -> None:
        self._do(C.Rmdir, volume, parent, name)

    async def rename(
        self, volume: str, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int
    ) -> None:
        expect = self.state.predict_drop(volume, new_parent, new_name)
        keep = self.opens.keep(self.state, volume, expect)
        self._do(C.Rename, volume, parent, name, new_parent, new_name, flags, None, expect, keep)
        self._purge()

    async def readlink(self, volume: str, ino: int) -> bytes:
        return self.state.readlink(volume, ino)

    async def readdir(self, volume: str, ino: int, cookie: int, limit: int) -> list:
        return self.state.readdir(volume, ino, cookie, limit)

    async def statfs(self, volume: str) -> dict[str, Any]:
        return self.state.statfs(volume)

    async def setxattr(self, volume: str, ino: int, name: bytes, value: bytes) -> None:
        self._do(C.SetXattr, volume, ino, name, value, 0)

    async def getxattr(self, volume: str, ino: int, name: bytes) -> bytes:
        return self.state.getxattr(volume, ino, name)

    async def listxattr(self, volume: str, ino: int) -> list[bytes]:
        return self.state.listxattr(volume, ino)

    async def removexattr(self, volume: str, ino: int, name: bytes) -> None:
        self._do(C.RemoveXattr, volume, ino, name)

    async def open(self, volume: str, ino: int, session: str) -> dict[str, Any]:
        attr = self.state.check_open(volume, ino, session)
        self.opens.open(volume, session, ino)
        return attr

    async def release(self, volume: str, ino: int, session: str) -> None:
        if self.opens.release(volume, session, ino):
            self._purge()

    async def alloc_slices(self, count: int) -> int:
        return self._do(C.AllocSlices, count)

    async def write_slice(self, volume, ino, chunk, slice_id, pos, length, offset, mtime_ns) -> Any:
        return self._do(C.WriteSlice, volume, ino, chunk, slice_id, pos, length, offset, mtime_ns)

    async def read_chunk(self, volume: str, ino: int, chunk: int) -> list:
        return self.state.read_chunk(volume, ino, chunk)

    async def compact_chunk(self, volume, ino, chunk, expect, slice_id, length) -> Any:
        return self._do(C.CompactChunk, volume, ino, chunk, list(expect), slice_id, length)


async def main_async(mountpoint: str, block_size: int, options: ClientOptions) -> int:
    meta = StateMeta(block_size)
    info = await meta.mount_volume(VOLUME, "localfs")
    cmap = {"volumes": {VOLUME: {"block_size": block_size}}, "cachenodes": []}
    async with RpcPool(secret=None) as pool:
        session = Session(
            meta,  # type: ignore[arg-type]
            VOLUME,
            info["session"],
            cmap,
            zone="",
            transport=TcpTransport(pool),
            backing=DictBacking(),  # type: ignore[arg-type]
        )

        def ready(error: str | None) -> None:
            print("ready" if error is None else f"error: {error}", flush=True)

        return await run_fs(session, mountpoint, options, ready)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mountpoint")
    parser.add_argument("--block-size", type=int, default=64 * 1024)
    parser.add_argument("--write-buffer", type=int, default=1 << 20)
    parser.add_argument("--l1", type=int, default=4 << 20)
    parser.add_argument("--compact-after", type=int, default=16)
    parser.add_argument("--read-only", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = ClientOptions(
        l1_bytes=args.l1,
        readahead_max=4 * args.block_size,
        write_buffer=args.write_buffer,
        attr_timeout=0.5,
        entry_timeout=0.5,
        read_only=args.read_only,
        compact_after=args.compact_after,
    )
    sys.exit(trio.run(main_async, args.mountpoint, args.block_size, options))


if __name__ == "__main__":
    main()
