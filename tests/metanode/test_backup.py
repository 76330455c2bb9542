"""``cachefs dump`` / ``cachefs load``: a volume's metadata backup.

The round trip runs real daemons: files written through the native client,
a dump taken while a writer goes on, the metadata wiped (fresh metanodes,
the same datanodes), the dump loaded, and every file reads back identical.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import trio
import zstandard

from cachefs import queries as Q
from cachefs.client.api import connect
from cachefs.errors import CacheFSError, InvalidArgument
from cachefs.metanode import backup
from cachefs.metanode.client import MetaClient
from cachefs.metanode.namespace import MetaState
from cachefs.metanode.snapshot import volume_row
from cachefs.rpc import RpcPool
from cachefs.testing.datanodes import Datanodes
from cachefs.testing.metacluster import MetaCluster

MiB = 1 << 20


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "cachefs.cli", *args], capture_output=True, text=True,
                          timeout=120)
    if check:
        assert done.returncode == 0, done.stderr
    return done


async def _datanodes_up(meta: str, n: int) -> None:
    async with RpcPool(secret=None) as pool:
        mc = MetaClient(pool, [meta])
        deadline = time.monotonic() + 30
        while True:
            cmap = await mc.query(Q.ClusterMap())
            if sum(d["state"] == "up" for d in cmap["datanodes"]) == n:
                return
            assert time.monotonic() < deadline, cmap
            await trio.sleep(0.2)


async def _restore(meta: str, blob: bytes) -> str:
    async with RpcPool(secret=None) as pool:
        try:
            await MetaClient(pool, [meta]).call("restore_volume", {}, payload=blob)
        except CacheFSError as exc:
            return str(exc)
    return "OK"


def _files(fs, top: str = "/") -> dict[str, str]:
    out = {}
    for root, _dirs, names in fs.walk(top):
        for name in names:
            path = f"{root.rstrip('/')}/{name}"
            out[path] = hashlib.sha256(fs.read_bytes(path)).hexdigest()
    return out


def test_dump_wipe_load_round_trip(tmp_path: Path) -> None:
    old = MetaCluster(tmp_path / "old", n=1)
    (tmp_path / "old").mkdir()
    old.start_all()
    nodes = Datanodes(tmp_path, ["a", "b", "c"], insecure=True,
                      extra=["--meta", old.addrs[0], "--heartbeat", "0.3"])
    new: MetaCluster | None = None
    try:
        nodes.start()
        trio.run(_datanodes_up, old.addrs[0], 3)
        cli("volume", "create", "data", "--policy", "ec:2+1", "--pg-count", "8", "--open",
            "--meta", old.addrs[0], "--insecure")
        with connect(old.addrs[0], "data") as fs:
            fs.makedirs("train/shard0")
            for i in range(12):
                fs.write_bytes(f"train/shard0/f{i}", os.urandom(i * 300_000 + i))  # 0 B .. 3.3 MB
            fs.write_bytes("big", os.urandom(70 * MiB))  # over one 64 MiB chunk
            fs.write_bytes("empty", b"")
            fs.symlink("train/shard0/f3", "link")
            before = _files(fs)

            # Dump while a writer goes on in another directory.
            stop = threading.Event()

            def writer() -> None:
                with connect(old.addrs[0], "data") as wfs:
                    wfs.makedirs("live")
                    n = 0
                    while not stop.is_set():
                        wfs.write_bytes(f"live/w{n}", os.urandom(100_000))
                        n += 1

            t = threading.Thread(target=writer)
            t.start()
            try:
                time.sleep(0.5)
                out = cli("dump", "data", str(tmp_path / "data.dump"), "--meta", old.addrs[0], "--insecure")
            finally:
                stop.set()
                t.join()
        assert "dumped volume data" in out.stdout
        dump = (tmp_path / "data.dump").read_bytes()
        assert dump.startswith(backup.MAGIC)
        live_dumped = {n for n in backup.parse(dump).volume.inodes}  # whatever was committed then
        assert len(live_dumped) > len(before)

        # Wipe the metadata: fresh metanodes, the same datanodes re-registering.
        old.stop_all()
        (tmp_path / "new").mkdir()
        new = MetaCluster(tmp_path / "new", n=1)
        new.start_all()
        nodes.stop_all()
        nodes.extra = ["--meta", new.addrs[0], "--heartbeat", "0.3"]
        nodes.start()
        trio.run(_datanodes_up, new.addrs[0], 3)

        # A hostile payload sent past the CLI is refused by the leader, which lives on.
        assert "EINVAL" in trio.run(_restore, new.addrs[0], dump[: len(dump) // 2])
        assert "EINVAL" in trio.run(_restore, new.addrs[0], b"junk")

        out = cli("load", str(tmp_path / "data.dump"), "--meta", new.addrs[0], "--insecure")
        assert "loaded volume data" in out.stdout
        again = cli("load", str(tmp_path / "data.dump"), "--meta", new.addrs[0], "--insecure", check=False)
        assert again.returncode == 1 and "not empty (volumes: data)" in again.stderr

        with connect(new.addrs[0], "data") as fs:
            after = _files(fs)
            assert {p: h for p, h in after.items() if not p.startswith("/live/")} == before
            assert fs.readlink("link") == "train/shard0/f3"
            # New writes get slice ids past every restored one: old files stay intact.
            fresh = os.urandom(5 * MiB)
            fs.write_bytes("after-load", fresh)
            assert fs.read_bytes("after-load") == fresh
            assert _files(fs, "/train") == {p: h for p, h in before.items() if p.startswith("/train/")}
    finally:
        nodes.stop_all()
        old.stop_all()
        if new is not None:
            new.stop_all()


def _sample_dump() -> bytes:
    state = MetaState()
    from cachefs import commands as C

    state.apply(1, C.CreateVolume("v", "replica:1", now_ns=1).encode())
    state.apply(2, C.Mkdir("v", 1, b"d", 0o755, now_ns=2).encode())
    return backup.dump_volume(state, "v")


def test_a_dump_loads_into_an_empty_state_and_equals_the_original() -> None:
    blob = _sample_dump()
    state = MetaState()
    backup.restore(state, backup.parse(blob))
    got, want = backup.parse(backup.dump_volume(state, "v")), backup.parse(blob)
    assert (volume_row(got.volume), got.spec, got.pgs) == (volume_row(want.volume), want.spec, want.pgs)
    # Slices start past the gap, and nothing may commit below it.
    assert state.next_slice == state.slice_floor == want.next_slice + backup.SLICE_GAP


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b[: len(b) - 7], "is truncated: its zstd frame does not end"),
        (lambda b: b[: len(backup.MAGIC) + 1], "ends inside the header"),
        (lambda b: b"NOT-A-DUMP" + b[10:], "not a cachefs metadata dump"),
        (lambda b: b"", "not a cachefs metadata dump"),
        (lambda b: backup.MAGIC + b"\x00\x07" + b[len(backup.MAGIC) + 2 :], "format version 7; this cachefs reads version 1"),
        (lambda b: backup.MAGIC + b"\x00\x01" + b"\x28\xb5\x2f\xfd" + os.urandom(64), "corrupt"),
        (lambda b: backup.MAGIC + b"\x00\x01" + zstandard.compress(msgpack.packb([1, 2])), "is corrupt"),
    ],
    ids=["truncated", "header-cut", "wrong-magic", "empty", "wrong-version", "garbage-body", "wrong-shape"],
)
def test_a_hostile_file_is_refused_naming_what_is_wrong(tmp_path: Path, mangle, message: str) -> None:
    bad = mangle(_sample_dump())
    with pytest.raises(InvalidArgument, match=message):
        backup.parse(bad, "x.dump")
    path = tmp_path / "bad.dump"
    path.write_bytes(bad)
    # The CLI refuses it before it talks to any metanode (none listens here).
    done = cli("load", str(path), "--meta", "127.0.0.1:9", "--insecure", check=False)
    assert done.returncode == 1 and message in done.stderr and str(path) in done.stderr
