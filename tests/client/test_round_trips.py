"""Round trips of the small-file mixed run (issue 16, item 7): a listing,
an fsync and a close each send the metanodes only what they must.

Counted from a real mount's metrics (``tests.client.localfs``: the real FUSE
client over a real metanode service, reached over real RPC; blocks live in
a dict there, so the only round trips are the metanode's).
"""

from __future__ import annotations

import os
import re

from .conftest import grown, mount_metrics, mount_ops


def _rpcs(port: int) -> dict[str, int]:
    """Metanode RPCs the mount sent so far, by method."""
    found = re.findall(r'^cachefs_mount_rpc_latency_seconds_count\{method="(\w+)"\} ([0-9.e+]+)$',
                       mount_metrics(port), re.M)
    return {method: int(float(n)) for method, n in found}


# Sent in the background whatever the workload does: not counted against it.
_BACKGROUND = {"lease_poll", "session_heartbeat", "cluster_map", "alloc_slices"}


def _sent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n for k, n in grown(before, after).items() if k not in _BACKGROUND}


def test_a_listing_asks_the_metanodes_once(metered) -> None:
    """``os.listdir`` of a directory of small files is one ``load_dir``: the
    kernel's second readdir, past the last entry, only learns that the
    listing ended, which the first page said already (before: two load_dir
    per listing). A new opendir, or a rewinddir, asks again and sees a
    file made since. (A listing the kernel kept, under the directory's
    lease, asks nothing at all: see test_leases.)"""
    m, port = metered
    d = m.path / "d"
    d.mkdir()
    for i in range(10):
        (d / f"f{i}").write_bytes(b"x" * 100)
    for i in range(3):
        before, ops = _rpcs(port), mount_ops(port)
        assert sorted(os.listdir(d)) == [f"f{i}" for i in range(10)]
        sent, asked = _sent(before, _rpcs(port)), grown(ops, mount_ops(port))
        if i and not sent and "readdir" not in asked:
            continue  # kept by the kernel
        assert sent == {"load_dir": 1}, (sent, asked)
        assert asked.get("readdir", 0) >= 2, asked  # the kernel did ask past the end
    (d / "new").write_bytes(b"y")
    assert "new" in os.listdir(d)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as it:
            first = sorted(e.name for e in it)
        assert "new" in first
        (d / "newer").write_bytes(b"z")
        os.lseek(fd, 0, os.SEEK_SET)  # rewinddir: the listing starts again
        with os.scandir(fd) as it:
            assert "newer" in {e.name for e in it}
    finally:
        os.close(fd)


def test_empty_directory_listing_sees_a_later_file_after_rewind(metered) -> None:
    """An empty directory's listing ends at cookie 0, which a rewinddir asks
    for again: it is asked of the metanodes, not taken as the end."""
    m, port = metered
    d = m.path / "empty"
    d.mkdir()
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as it:
            assert [e.name for e in it] == []
        (d / "late").write_bytes(b"l")
        os.lseek(fd, 0, os.SEEK_SET)
        with os.scandir(fd) as it:
            assert [e.name for e in it] == ["late"]
    finally:
        os.close(fd)


def test_fsync_and_close_with_nothing_new_send_nothing(metered) -> None:
    """The mixed run's file: create, writes, fsync, close. The fsync commits
    the writes (one ``write_slice``); the close after it, a second fsync,
    and the close of a file only read, find nothing to commit and send
    nothing. (A guard: the writer already skipped such commits.)"""
    m, port = metered
    (m.path / "w").mkdir()  # made here: known empty, so the create needs no lookup
    path = m.path / "w" / "f"
    before = _rpcs(port)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"a" * 4096)
    os.write(fd, b"b" * 16384)
    created = _sent(before, _rpcs(port))
    assert created == {"mknod": 1}, created
    os.fsync(fd)
    synced = _sent(before, _rpcs(port))
    assert synced == {"mknod": 1, "write_slice": 1}, synced
    os.fsync(fd)
    os.close(fd)
    assert _sent(before, _rpcs(port)) == synced
    with open(path, "rb") as f:
        assert f.read() == b"a" * 4096 + b"b" * 16384
        os.fsync(f.fileno())
    assert _sent(before, _rpcs(port)) == synced
