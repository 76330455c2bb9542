"""Space is charged by what is stored, not by logical size (issue 16, items 1 and 2).

On the test cluster (3 datanodes of 8 GiB, ec:2+1: 16 GiB of file bytes), a
1-byte write at 100 GiB and a truncate to 1 TiB store (almost) nothing and
must succeed; shrinking never needs space; directory usage, quotas and
``statfs`` count the same stored bytes.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.layout import MAX_FILE_SIZE
from cachefs.messages import Usage
from cachefs.rpc import RpcPool

from .conftest import ClusterMount

pytestmark = pytest.mark.needs_fuse

GIB = 1 << 30


def meta(lab, command: C.Command | Q.Query) -> Usage:
    async def go() -> Usage:
        async with RpcPool(secret=lab.secret) as pool:
            client = lab.meta_client(pool, deadline=10)
            if isinstance(command, C.Command):
                return await client.mutate(command)
            return await client.query(command)

    return trio.run(go)


def used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_sparse_files_and_truncates_cost_what_they_store(cluster_mount: ClusterMount) -> None:
    lab, mnt = cluster_mount.lab, cluster_mount.path
    d = mnt / f"space-{os.getpid()}"
    d.mkdir()
    dino = os.stat(d).st_ino
    try:
        before = used(mnt)
        f = d / "sparse"
        fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
        os.pwrite(fd, b"x", 100 * GIB)  # far past the cluster's capacity
        os.close(fd)  # the commit: it stores one byte
        assert f.stat().st_size == 100 * GIB + 1
        with open(f, "rb") as r:
            assert os.pread(r.fileno(), 2, 100 * GIB - 1) == b"\0x"
        assert meta(lab, Q.GetUsage("lab", dino)).bytes == 1

        os.truncate(f, 0)  # shrinking never needs space
        os.truncate(f, 1 << 40)  # 1 TiB: stores nothing
        assert f.stat().st_size == 1 << 40
        os.truncate(f, MAX_FILE_SIZE)  # up to the largest file
        with pytest.raises(OSError) as exc:
            os.truncate(f, MAX_FILE_SIZE + 1)
        assert exc.value.errno == errno.EFBIG
        assert meta(lab, Q.GetUsage("lab", dino)).bytes == 0

        data = os.urandom(1 << 20)
        with open(d / "real", "wb") as w:
            w.write(data)
            os.fsync(w.fileno())
        assert meta(lab, Q.GetUsage("lab", dino)).bytes == 1 << 20
        assert abs(used(mnt) - before - (1 << 20)) <= 2 * os.statvfs(mnt).f_frsize

        # A quota counts the same bytes: a huge sparse file fits under 2 MiB,
        # a second MiB of data does too, a third does not.
        meta(lab, C.SetQuota("lab", dino, 2 << 20, None))
        os.truncate(f, 10 * GIB)
        with open(f, "r+b") as w:
            w.seek(5 * GIB)
            w.write(data)
            w.flush()
            os.fsync(w.fileno())
        # the error comes at the write, the flush or the fsync
        with pytest.raises(OSError) as exc, open(d / "over", "wb") as w:  # noqa: PT012
            w.write(data)
            w.flush()
            os.fsync(w.fileno())
        assert exc.value.errno == errno.EDQUOT
        assert (d / "real").read_bytes() == data
        os.truncate(f, 0)  # over quota, shrinking still works
        os.unlink(d / "over")
        assert meta(lab, Q.GetUsage("lab", dino)).bytes == 1 << 20
    finally:
        meta(lab, C.SetQuota("lab", dino, None, None))
        shutil.rmtree(d)
