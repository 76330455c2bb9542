"""The client over a cluster of real processes: consistency, big files, failures.

One cluster (metanodes on Raft, datanodes with ec:2+1, cache nodes in two
zones) serves the whole module; each test mounts it with ``cachefs mount -d``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from cachefs import queries as Q
from cachefs.testing.labs import lab_processes
from cachefs.testing.ports import free_port

from .conftest import REPO, ClusterMount, mounted

FIO_DIR = REPO / "bench" / "fio"


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def test_posix_basics_on_the_cluster(cluster_mount: ClusterMount) -> None:
    mnt = cluster_mount.path
    data = os.urandom(5 << 20)
    os.mkdir(mnt / "d")
    (mnt / "d" / "f").write_bytes(data)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    assert (mnt / "d" / "f").read_bytes() == data
    os.rename(mnt / "d" / "f", mnt / "g")
    os.symlink("g", mnt / "s")
    os.link(mnt / "g", mnt / "h")
    assert sorted(os.listdir(mnt)) == ["d", "g", "h", "s"]
    fd = os.open(mnt / "g", os.O_RDONLY)
    os.unlink(mnt / "g")
    os.unlink(mnt / "h")
    assert os.pread(fd, 100, 1 << 20) == data[1 << 20 : (1 << 20) + 100]
    os.close(fd)
    os.setxattr(mnt / "d", "user.k", b"v")
    assert os.getxattr(mnt / "d", "user.k") == b"v"


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_verify_crc32c_on_the_cluster(cluster_mount: ClusterMount, tmp_path: Path) -> None:
    env = {**os.environ, "DIR": str(cluster_mount.path), "SIZE": str(64 << 20)}
    proc = subprocess.run(["fio", str(FIO_DIR / "verify-mixed.fio")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert proc.stdout.count("err= 0") == 2


def test_close_to_open_between_two_mounts(cluster, tmp_path: Path) -> None:
    a = ClusterMount(cluster, tmp_path)
    b = ClusterMount(cluster, tmp_path)
    try:
        first = os.urandom(3 << 20)
        (a.path / "shared").write_bytes(first)
        assert (b.path / "shared").read_bytes() == first  # written and closed on a, opened on b
        second = os.urandom(2 << 20)
        with open(a.path / "shared", "r+b") as f:
            f.write(second)
        # b's page cache holds the old bytes; its next open must not use them.
        assert (b.path / "shared").read_bytes() == second + first[len(second) :]
        with open(b.path / "shared", "ab") as f:
            f.write(b"tail")
        assert (a.path / "shared").read_bytes()[-6:] == first[-2:] + b"tail"
        os.mkdir(a.path / "dir")
        time.sleep(0.6)  # past the entry timeout
        assert os.path.isdir(b.path / "dir")
    finally:
        a.stop()
        b.stop()
    a.check_log()
    b.check_log()


def test_large_file_round_trip(cluster_mount: ClusterMount) -> None:
    """1 GiB written and read back with the same checksum."""
    path = cluster_mount.path / "big"
    h = hashlib.sha256()
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for i in range(1024):
            piece = block[i % 7 :] + block[: i % 7]
            h.update(piece)
            f.write(piece)
    assert path.stat().st_size == 1 << 30
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    assert _sha(path) == h.hexdigest()
    os.unlink(path)


def test_reads_go_on_when_the_cache_tier_dies(cluster, cluster_mount: ClusterMount) -> None:
    path = cluster_mount.path / "cached"
    data = os.urandom(48 << 20)
    path.write_bytes(data)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    assert _sha(path) == hashlib.sha256(data).hexdigest()  # fills the cache tier
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    caches = [n.name for n in cluster.of_kind("cachenode")]
    got = hashlib.sha256()
    try:
        with open(path, "rb", buffering=0) as f:
            for i in range(48):
                if i == 8:
                    for name in caches:
                        cluster.kill(name)
                got.update(f.read(1 << 20))
        assert got.hexdigest() == hashlib.sha256(data).hexdigest()
    finally:
        with lab_processes():
            for name in caches:
                cluster.start(name)


METADATA_WORKLOAD = r"""
import os, sys
root = sys.argv[1]
done = open(sys.argv[2], "w", buffering=1)
for i in range(int(sys.argv[3])):
    d = os.path.join(root, f"d{i}")
    os.mkdir(d)
    with open(os.path.join(d, "f"), "wb") as f:
        f.write(str(i).encode())
    done.write(f"{i}\n")
"""


def test_metanode_leader_killed_during_metadata_workload(cluster, cluster_mount: ClusterMount, tmp_path: Path) -> None:
    root = cluster_mount.path / "meta"
    os.mkdir(root)
    progress = tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-c", METADATA_WORKLOAD, str(root), str(progress), "150"])
    leader = None
    try:
        deadline = time.monotonic() + 60
        while (not progress.exists() or len(progress.read_text().split()) < 30) and time.monotonic() < deadline:
            time.sleep(0.05)
        leader = _leader(cluster)
        cluster.kill(leader)
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if leader is not None:
            with lab_processes():
                cluster.start(leader)
    acknowledged = [int(x) for x in progress.read_text().split()]
    assert len(acknowledged) == 150
    for i in acknowledged:
        assert (root / f"d{i}" / "f").read_bytes() == str(i).encode()


def _leader(cluster) -> str:
    import trio

    from cachefs.rpc import RpcPool

    async def find() -> str:
        async with RpcPool(secret=cluster.secret) as pool:
            meta = cluster.meta_client(pool, deadline=30.0)
            await meta.query(Q.ClusterMap())
            addr = meta.leader
        return next(n.name for n in cluster.of_kind("metanode") if n.addr == addr)

    return trio.run(find)


def test_client_killed_with_dirty_data(cluster, tmp_path: Path) -> None:
    m = ClusterMount(cluster, tmp_path)
    committed = os.urandom(6 << 20)
    (m.path / "committed").write_bytes(committed)
    f = open(m.path / "dirty", "wb")  # noqa: SIM115 - left open on purpose
    f.write(os.urandom(1 << 20))
    f.flush()
    os.kill(m.pid, signal.SIGKILL)
    try:
        f.close()
    except OSError:
        pass
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=False)
    deadline = time.monotonic() + 10
    while mounted(m.path) and time.monotonic() < deadline:
        time.sleep(0.05)
    m2 = ClusterMount(cluster, tmp_path)
    try:
        assert (m2.path / "committed").read_bytes() == committed
    finally:
        m2.stop()
    m2.check_log()


def test_a_mount_restarted_where_one_crashed_ends_the_crashed_ones_session(cluster, tmp_path: Path) -> None:
    """A mount killed with -9 keeps its session, and the leases it holds,
    until they lapse: another mount's change of a directory it leased waits
    for that. Mounted again at the same mount point, the new mount ends the
    crashed one's session at once (client/predecessor.py)."""
    from cachefs.client.mount import session_record
    from cachefs.client.predecessor import read
    from cachefs.rpc import RpcPool

    a, b = ClusterMount(cluster, tmp_path), ClusterMount(cluster, tmp_path)
    try:
        (b.path / "leased").mkdir()
        (b.path / "leased" / "f").write_bytes(b"x")
        assert os.listdir(a.path / "leased") == ["f"]  # A leases the directory and f
        old = read(session_record(a.path))
        assert old is not None and old.pid == a.pid and old.volume == "lab"
        os.kill(a.pid, signal.SIGKILL)
        subprocess.run(["fusermount3", "-u", "-z", str(a.path)], check=False)
        deadline = time.monotonic() + 10
        while mounted(a.path) and time.monotonic() < deadline:
            time.sleep(0.05)

        async def alive() -> bool:
            async with RpcPool(secret=cluster.secret) as pool:
                return await cluster.meta_client(pool, deadline=10.0).query(Q.SessionHeartbeat(old.session))

        assert trio.run(alive)  # silent for a moment only: not expired yet
        again = ClusterMount(cluster, tmp_path, path=a.path)
        try:
            deadline = time.monotonic() + 10
            while f"ended session {old.session}" not in again.log():
                assert time.monotonic() < deadline, again.log()
                time.sleep(0.05)
            assert not trio.run(alive)
            (b.path / "leased" / "g").write_bytes(b"y")  # no lease of the crashed mount to wait for
            assert sorted(os.listdir(again.path / "leased")) == ["f", "g"]
        finally:
            again.stop()
        again.check_log()
        assert read(session_record(a.path)) is None  # a clean unmount removes its record
    finally:
        shutil.rmtree(b.path / "leased", ignore_errors=True)
        b.stop()


def test_mount_errors_are_clear(cluster, tmp_path: Path) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    base = [sys.executable, "-m", "cachefs.cli", "mount"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*base, *args], cwd=REPO, capture_output=True, text=True, timeout=120)

    meta = ",".join(cluster.meta_addrs)
    r = run(meta, "no-such-volume", str(mp), "-d", "--secret-file", str(cluster.secret_file))
    assert r.returncode != 0 and "volume 'no-such-volume' does not exist" in r.stderr, r.stderr
    bad = tmp_path / "bad-secret"
    bad.write_text("not-the-secret\n")
    r = run(meta, "lab", str(mp), "-d", "--secret-file", str(bad))
    assert r.returncode != 0 and "refused the cluster secret" in r.stderr, r.stderr
    r = run("127.0.0.1:9", "lab", str(mp), "-d", "--insecure", "--connect-timeout", "1")  # default: 10 s
    assert r.returncode != 0 and "cannot reach the metanodes at 127.0.0.1:9 within 1s" in r.stderr, r.stderr
    assert not mounted(mp)


def _gc(cluster, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "cachefs.cli", "gc", "--meta", ",".join(cluster.meta_addrs),
            "--volume", "lab", "--secret-file", str(cluster.secret_file), *args]  # fmt: skip
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_gc_deletes_trashed_blocks_and_check_finds_missing_ones(cluster, cluster_mount: ClusterMount) -> None:
    import trio

    from cachefs.backing.client import BackingClient
    from cachefs.backing.cluster import MetaClusterView
    from cachefs.backing.gc import record_block_keys
    from cachefs.rpc import RpcPool

    mnt = cluster_mount.path
    keep = os.urandom(9 << 20)
    (mnt / "keep").write_bytes(os.urandom(9 << 20))
    (mnt / "keep").write_bytes(keep)  # O_TRUNC: the first 9 MiB go to the trash
    (mnt / "gone").write_bytes(os.urandom(5 << 20))
    os.unlink(mnt / "gone")
    r = _gc(cluster, "--grace", "0")  # reports by default
    assert r.returncode == 0, r.stderr
    pending = int(r.stdout.split("would purge ")[1].split()[0])
    assert pending >= 2 and "nothing deleted" in r.stdout, r.stdout
    r = _gc(cluster, "--grace", "0")
    assert int(r.stdout.split("would purge ")[1].split()[0]) == pending, r.stdout  # nothing was purged
    r = _gc(cluster, "--grace", "0", "--delete")
    assert r.returncode == 0, r.stderr
    purged = int(r.stdout.split("purged ")[1].split()[0])
    assert purged == pending, r.stdout
    r = _gc(cluster, "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "missing: 0" in r.stdout
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    assert (mnt / "keep").read_bytes() == keep

    async def drop_one_block() -> str:
        async with RpcPool(secret=cluster.secret) as pool:
            meta = cluster.meta_client(pool)
            view = MetaClusterView(meta)
            await view.refresh()
            ino = (await meta.query(Q.Lookup("lab", 1, b"keep"))).ino
            rec = (await meta.query(Q.ReadChunk("lab", ino, 0)))[0]
            key = sorted(record_block_keys(rec, 4 << 20))[0]
            await BackingClient(pool, view).delete_block("lab", key)
            return key.hex()

    lost = trio.run(drop_one_block)
    r = _gc(cluster, "--check")
    assert r.returncode == 1 and "missing: 1" in r.stdout and lost in r.stdout, r.stdout + r.stderr
    os.unlink(mnt / "keep")


HOLDER = r"""
import sys, time
f = open(sys.argv[1], "wb")
f.write(b"u" * (3 << 20))
f.flush()  # into the mount's write buffer; the file stays open, nothing committed yet
print("written", flush=True)
time.sleep(120)
"""


def test_umount_commits_dirty_data_of_open_files(cluster, tmp_path: Path) -> None:
    m = ClusterMount(cluster, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(m.path / "open")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "written"
        m.stop()  # cachefs umount: the daemon commits, then unmounts
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    m2 = ClusterMount(cluster, tmp_path)
    try:
        assert (m2.path / "open").read_bytes() == b"u" * (3 << 20)
    finally:
        m2.stop()
    m.check_log()
    m2.check_log()


def _cache_stats(cluster) -> dict[str, dict]:
    import trio

    from cachefs.rpc import RpcPool

    async def get() -> dict[str, dict]:
        async with RpcPool(secret=cluster.secret) as pool:
            return {n.name: (await pool.call(n.addr, "stats", timeout=10)).result for n in cluster.of_kind("cachenode")}

    return trio.run(get)


def test_write_through_fills_the_cache_tier_and_reads_hit_it(cluster, tmp_path: Path) -> None:
    import urllib.request

    port = free_port()
    m = ClusterMount(cluster, tmp_path, "--write-through", "--l1-size", "0", "--metrics-addr", str(port))
    try:
        before = _cache_stats(cluster)
        data = os.urandom(16 << 20)
        (m.path / "ckpt").write_bytes(data)
        after = _cache_stats(cluster)
        assert sum(a["puts"] - b["puts"] for a, b in zip(after.values(), before.values(), strict=True)) >= 4
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        assert (m.path / "ckpt").read_bytes() == data
        read = _cache_stats(cluster)
        assert sum(r["hits"] - a["hits"] for r, a in zip(read.values(), after.values(), strict=True)) >= 4
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'cachefs_mount_l1_capacity_bytes 0.0' in metrics
        assert 'cachefs_mount_blocks_total{what="write_through"}' in metrics
    finally:
        m.stop()
    m.check_log()


def test_unlinked_open_file_survives_a_leader_kill_between_open_and_unlink(cluster, tmp_path: Path) -> None:
    """open() is soft state on the metanode leader; kill it, unlink from another
    mount (on the new leader), and the held file still reads whole, across the
    new leader learning the open from the heartbeats, until it is closed."""
    writer, reader = ClusterMount(cluster, tmp_path), ClusterMount(cluster, tmp_path)
    data = os.urandom(5 << 20)
    leader = None
    try:
        (writer.path / "held").write_bytes(data)
        held = open(reader.path / "held", "rb", buffering=0)  # noqa: SIM115 - closed below
        try:
            leader = _leader(cluster)
            cluster.kill(leader)
            os.unlink(writer.path / "held")
            assert not (writer.path / "held").exists()
            assert held.read(1 << 20) == data[: 1 << 20]  # first read after the unlink
            time.sleep(6)  # a session heartbeat has announced the open meanwhile
            assert held.read() == data[1 << 20 :]
        finally:
            held.close()
    finally:
        if leader is not None:
            with lab_processes():
                cluster.start(leader)
        writer.stop()
        reader.stop()
    writer.check_log()
    reader.check_log()


def test_compaction_keeps_what_another_mount_appended(cluster, tmp_path: Path) -> None:
    """Issue 14, item 1: A's compactor must not size the new slice by A's
    cached file size. A makes 64 fsynced 100-byte writes (a compaction is
    due 0.5 s after its commits); before it runs, B appends 4 KiB and
    fsyncs, which A's cached size does not know. After A compacted and the
    GC ran, a third mount reads every byte, B's included."""
    a = ClusterMount(cluster, tmp_path)
    b = ClusterMount(cluster, tmp_path)
    name = f"compacted-{os.getpid()}"
    parts = [os.urandom(100) for _ in range(64)]
    tail = os.urandom(4096)
    try:
        with open(a.path / name, "wb") as f:
            for part in parts:
                f.write(part)
                f.flush()
                os.fsync(f.fileno())
            with open(b.path / name, "ab") as g:  # opened on B: B sees A's 6400 bytes
                g.write(tail)
                g.flush()
                os.fsync(g.fileno())
        deadline = time.monotonic() + 30
        while "compacted chunk 0" not in a.log():
            assert time.monotonic() < deadline, a.log()
            time.sleep(0.2)
    finally:
        a.stop()
        b.stop()
    a.check_log()
    b.check_log()
    r = _gc(cluster, "--grace", "0")
    assert r.returncode == 0, r.stderr
    c = ClusterMount(cluster, tmp_path)
    try:
        assert (c.path / name).read_bytes() == b"".join(parts) + tail
        os.unlink(c.path / name)
    finally:
        c.stop()
    c.check_log()


def test_a_taken_metrics_port_fails_the_mount_and_unmounts(cluster, tmp_path: Path) -> None:
    """A --metrics-addr already in use fails the mount with an error naming
    it, and leaves nothing mounted. Before, the failure came after the FUSE
    mount and before its loop: the process then hung in a stat of its own
    mount point, and ``cachefs mount -d`` waited forever."""
    import socket

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "cachefs.cli", "mount", ",".join(cluster.meta_addrs), "lab", str(mnt), "-d",
                "--secret-file", str(cluster.secret_file), "--log-file", str(tmp_path / "mount.log"),
                "--metrics-addr", f"127.0.0.1:{port}"]  # fmt: skip
        try:
            proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
        finally:
            if mounted(mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
    assert proc.returncode != 0
    assert f"cannot serve metrics on 127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert not mounted(mnt)
