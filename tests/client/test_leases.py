"""Metadata leases between real mounts: what one mount answers from memory
never hides another mount's change (revocation, lapse, failover).

Each test mounts the module cluster twice: mount A reads (and so holds
leases on what it read), mount B changes things. After B's call returns, A's
next stat or open must show it: B's change was applied only once A
acknowledged the revocation (its kernel caches gone) or A's lease lapsed.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import stat
import time
import urllib.request
import uuid
from pathlib import Path

from cachefs.client.compaction import COMPACT_DELAY
from cachefs.testing.labs import lab_processes
from cachefs.testing.ports import free_port

from .conftest import LEASE_TERM, ClusterMount
from .test_cluster import _leader


class Pair:
    """Mount A (the reader, with metrics) and mount B (the writer) of one volume."""

    def __init__(self, cluster, tmp_path: Path) -> None:
        self.port = free_port()
        self.a = ClusterMount(cluster, tmp_path, "--metrics-addr", str(self.port))
        try:
            self.b = ClusterMount(cluster, tmp_path)
        except BaseException:
            self.a.stop()
            raise
        self.name = f"leases-{uuid.uuid4().hex[:8]}"
        os.mkdir(self.b.path / self.name)

    def stop(self) -> None:
        """Unmount both, the test's directory removed first (the cluster's
        volume root is shared by the module's tests)."""
        try:
            shutil.rmtree(self.b.path / self.name)
        finally:
            try:
                self.a.stop()
            finally:
                self.b.stop()
        self.a.check_log()
        self.b.check_log()

    def hits(self) -> int:
        """Lookups, getattrs and opens mount A answered under its leases."""
        return self._metric("cachefs_mount_lease_events_total", "event", "hits")

    def ops(self, op: str) -> int:
        """FUSE requests of ``op`` mount A answered (0 before the first)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        m = re.search(rf'^cachefs_mount_op_latency_seconds_count\{{op="{op}"\}} ([0-9.e+]+)$', text, re.M)
        return int(float(m.group(1))) if m else 0

    def slice_lists(self) -> int:
        """Slice lists mount A asked the metanodes for."""
        return self._metric("cachefs_mount_slice_lists_total")

    def rpcs(self) -> dict[str, int]:
        """Metanode RPCs mount A sent, by method."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        found = re.findall(r'^cachefs_mount_rpc_latency_seconds_count\{method="(\w+)"\} ([0-9.e+]+)$', text, re.M)
        return {method: int(float(n)) for method, n in found}

    def _metric(self, family: str, label: str = "", value: str = "") -> int:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        labels = rf'\{{{label}="{value}"\}}' if label else ""
        m = re.search(rf"^{family}{labels} ([0-9.e+]+)$", text, re.M)
        assert m, text[-2000:]
        return int(float(m.group(1)))


def _check(root: Path, model: dict[str, tuple[int, bytes]]) -> None:
    """``root`` holds exactly the model's files, with its modes and contents.
    Stats come first and last: a read invalidates the kernel's cached atime,
    so only a stat after the last read leaves the kernel's attribute cache
    full for the next check to test."""
    _stat_all(root, model)
    for name, (_, data) in model.items():
        assert (root / name).read_bytes() == data, name
    _stat_all(root, model)
    assert sorted(os.listdir(root)) == sorted(model)


def _stat_all(root: Path, model: dict[str, tuple[int, bytes]]) -> None:
    for name, (mode, data) in model.items():
        st = os.stat(root / name)
        assert stat.S_IMODE(st.st_mode) == mode, name
        assert st.st_size == len(data), name


def test_a_reader_sees_every_change_of_another_mount_by_its_next_stat_and_open(cluster, tmp_path: Path) -> None:
    """B renames, unlinks, chmods, truncates and rewrites while A holds leases
    on everything; A checks the whole directory against the model after each
    change, at once (A's attribute and entry timeouts alone are 0.5 s, and
    its leases last seconds: only the revocations make A see the changes)."""
    pair = Pair(cluster, tmp_path)
    rng = random.Random(13)
    try:
        a, b = pair.a.path / pair.name, pair.b.path / pair.name
        model: dict[str, tuple[int, bytes]] = {}
        for i in range(6):
            data = rng.randbytes(rng.choice([0, 100, 70_000]))
            (b / f"f{i}").write_bytes(data)
            os.chmod(b / f"f{i}", 0o644)
            model[f"f{i}"] = (0o644, data)
        _check(a, model)
        hits = pair.hits()
        _check(a, model)  # unchanged: the kernel's caches, and every open under A's leases
        assert pair.hits() - hits >= len(model)
        for step in range(40):
            name = rng.choice(sorted(model))
            op = rng.choice(["rename", "unlink", "chmod", "truncate", "rewrite", "create"])
            mode, data = model[name]
            if op == "rename":
                new = rng.choice([*model, f"r{step}"])  # maybe over an existing file
                os.rename(b / name, b / new)
                model[new] = model.pop(name)
            elif op == "unlink" and len(model) > 2:
                os.unlink(b / name)
                del model[name]
            elif op == "chmod":
                mode = rng.choice([0o600, 0o640, 0o444, 0o755])
                os.chmod(b / name, mode)
                model[name] = (mode, data)
            elif op == "truncate":
                size = rng.randrange(0, len(data) + 1000)
                os.truncate(b / name, size)
                model[name] = (mode, data[:size] + bytes(max(0, size - len(data))))
            elif op == "rewrite":
                data = rng.randbytes(rng.choice([10, 5000, 200_000]))
                if not mode & 0o200:
                    os.chmod(b / name, mode | 0o200)
                (b / name).write_bytes(data)
                os.chmod(b / name, mode)
                model[name] = (mode, data)
            else:
                data = rng.randbytes(300)
                (b / f"c{step}").write_bytes(data)
                os.chmod(b / f"c{step}", 0o644)
                model[f"c{step}"] = (0o644, data)
            _check(a, model)
            _check(b, model)
    finally:
        pair.stop()


def test_a_listing_leases_the_entries_and_their_first_slice_lists(cluster, tmp_path: Path) -> None:
    """After A lists a directory B filled, A opens and reads every file with no
    lookup, no open and no slice list asked of the metanodes (the first epoch
    of a data loader after its listing)."""
    pair = Pair(cluster, tmp_path)
    try:
        a, b = pair.a.path / pair.name, pair.b.path / pair.name
        files = {f"f{i:02d}": os.urandom(1000 + 997 * i) for i in range(20)}
        for name, data in files.items():
            (b / name).write_bytes(data)
        assert sorted(os.listdir(a)) == sorted(files)
        hits, lists = pair.hits(), pair.slice_lists()
        for name, data in files.items():
            assert (a / name).read_bytes() == data
        assert pair.hits() - hits >= len(files)  # every open under a lease
        assert pair.slice_lists() == lists
        (b / "f00").write_bytes(b"changed")  # and a change is still seen at once
        assert (a / "f00").read_bytes() == b"changed"
    finally:
        pair.stop()


def test_a_created_file_is_opened_and_closed_and_stated_with_no_round_trip_but_the_create(cluster, tmp_path: Path) -> None:
    """The create's answer leases the new file (its open and release stay in
    the mount, the kernel's getxattr of security.capability is answered
    from the lease) and brings the directory's attributes; the commit at
    the file's end trashes nothing (the open stays unannounced), and its
    answer keeps the file's attributes; the compactor knows a file created
    here has one slice and reads no slice list. The directory was made
    here, so its lease says it was empty and the kernel's lookup before
    each create is answered from memory. Unlinks are one trip each: the
    names are known, and the answer brings the directory's attributes
    that the kernel asks next; so are renames (the answer brings the
    file's too). B still sees each file, and B's create in A's directory
    is seen by A's next lookup (it revoked A's lease)."""
    pair = Pair(cluster, tmp_path)
    try:
        os.mkdir(pair.a.path / pair.name / "d")
        a, b = pair.a.path / pair.name / "d", pair.b.path / pair.name / "d"
        files = {f"f{i:02d}": os.urandom(100 + 997 * i) for i in range(20)}
        before = pair.rpcs()
        for name, data in files.items():
            with open(a / name, "wb") as f:
                f.write(data)
        for name, data in files.items():
            assert os.stat(a / name).st_size == len(data)
        time.sleep(3 * COMPACT_DELAY)  # when the compactor would have looked at each file's slice list
        sent = {m: n - before.get(m, 0) for m, n in pair.rpcs().items() if n > before.get(m, 0)}
        assert sent.get("mknod") == len(files), sent
        assert sent.get("write_slice") == len(files), sent
        for method in ("lease_open", "open", "getxattr", "lease_getattr", "getattr", "release", "read_chunk",
                       "lease_lookup", "lookup"):  # fmt: skip
            assert method not in sent, sent
        for name, data in files.items():
            assert (b / name).read_bytes() == data
        (b / "f00").write_bytes(b"changed by b")  # revokes A's lease on the file it created
        assert (a / "f00").read_bytes() == b"changed by b"

        os.mkdir(pair.a.path / pair.name / "e")
        e = pair.a.path / pair.name / "e"
        for name in files:
            (e / name).write_bytes(b"x")
        before = pair.rpcs()
        for name in files:
            os.unlink(e / name)
        sent = {m: n - before.get(m, 0) for m, n in pair.rpcs().items() if n > before.get(m, 0)}
        assert sent.get("unlink") == len(files), sent
        for method in ("lease_lookup", "lookup", "lease_getattr", "getattr"):
            assert method not in sent, sent
        assert os.listdir(pair.b.path / pair.name / "e") == []
        assert not (e / "f01").exists()  # still answered from memory: the directory is known empty

        (e / "r0").write_bytes(b"renamed")
        before = pair.rpcs()
        os.rename(e / "r0", e / "r1")
        assert os.stat(e / "r1").st_size == 7 and not (e / "r0").exists()
        sent = {m: n - before.get(m, 0) for m, n in pair.rpcs().items() if n > before.get(m, 0)}
        assert sent.get("rename") == 1, sent  # it brings the file's and the directory's attributes
        for method in ("lease_lookup", "lookup", "lease_getattr", "getattr"):
            assert method not in sent, sent
        (pair.b.path / pair.name / "e" / "late").write_bytes(b"from b")  # revokes A's lease on e
        assert (e / "late").read_bytes() == b"from b"
        assert sorted(os.listdir(e)) == ["late", "r1"] and (e / "r1").read_bytes() == b"renamed"
    finally:
        pair.stop()


def test_a_frozen_holder_delays_a_change_by_at_most_the_lease_term(cluster, tmp_path: Path) -> None:
    pair = Pair(cluster, tmp_path)
    try:
        a, b = pair.a.path / pair.name, pair.b.path / pair.name
        (b / "f").write_bytes(b"old")
        os.chmod(b / "f", 0o644)
        assert (a / "f").read_bytes() == b"old"
        assert stat.S_IMODE(os.stat(a / "f").st_mode) == 0o644
        assert _listings_until_kept(pair, a, ["f"]) == 0  # the kernel keeps the listing
        os.kill(pair.a.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            os.chmod(b / "f", 0o600)
            (b / "f").write_bytes(b"new contents")
            (b / "g").write_bytes(b"made while A was frozen")
            took = time.monotonic() - start
        finally:
            os.kill(pair.a.pid, signal.SIGCONT)
        assert took < LEASE_TERM + 4.0, took
        assert stat.S_IMODE(os.stat(a / "f").st_mode) == 0o600
        assert (a / "f").read_bytes() == b"new contents"
        assert sorted(os.listdir(a)) == ["f", "g"]
    finally:
        pair.stop()


def test_nothing_stale_is_served_after_the_leader_is_killed(cluster, tmp_path: Path) -> None:
    pair = Pair(cluster, tmp_path)
    leader = None
    try:
        a, b = pair.a.path / pair.name, pair.b.path / pair.name
        for i in range(5):
            (b / f"f{i}").write_bytes(b"v1")
        for i in range(5):
            assert (a / f"f{i}").read_bytes() == b"v1"
            os.stat(a / f"f{i}")
        assert _listings_until_kept(pair, a, [f"f{i}" for i in range(5)]) == 0
        leader = _leader(cluster)
        cluster.kill(leader)
        start = time.monotonic()
        (b / "f0").write_bytes(b"version two")
        os.chmod(b / "f1", 0o600)
        os.rename(b / "f2", b / "g2")
        os.unlink(b / "f3")
        took = time.monotonic() - start
        assert (a / "f0").read_bytes() == b"version two"
        assert stat.S_IMODE(os.stat(a / "f1").st_mode) == 0o600
        assert not (a / "f2").exists() and (a / "g2").read_bytes() == b"v1"
        assert not (a / "f3").exists()
        assert (a / "f4").read_bytes() == b"v1"
        assert sorted(os.listdir(a)) == ["f0", "f1", "f4", "g2"]
        assert took < 30 + LEASE_TERM, took
    finally:
        if leader is not None:
            with lab_processes():
                cluster.start(leader)
        pair.stop()


def _pread(path: Path, size: int) -> bytes:
    """``size`` bytes from the start of a new open of ``path``: no fstat and
    no read past the end, so the kernel neither refreshes the attributes nor
    checks the size before it answers from its page cache. Only the mount's
    own answer to the open (keep the pages or not) and its invalidations
    stand between a stale page and the caller."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def test_the_kernel_serves_no_stale_pages_after_another_mount_rewrites_a_file(cluster, tmp_path: Path) -> None:
    """A's second read of an unchanged file comes from the kernel's page
    cache (no read reaches mount A) and its read-only close sends no flush;
    after B rewrites the file in place with bytes of the same size, A's next
    open reads B's bytes: with A's lease revoked, with the file still open
    on A across the change, and with A frozen while B changed it (its lease
    lapsed unacknowledged)."""
    pair = Pair(cluster, tmp_path)
    size = 70_000
    try:
        a, b = pair.a.path / pair.name / "f", pair.b.path / pair.name / "f"
        b.write_bytes(os.urandom(size))

        def rewrite() -> bytes:
            data = os.urandom(size)
            with open(b, "r+b") as f:
                f.write(data)
            return data

        data = rewrite()
        assert _pread(a, size) == data
        reads, flushes = pair.ops("read"), pair.ops("flush")
        assert _pread(a, size) == data
        assert (pair.ops("read"), pair.ops("flush")) == (reads, flushes)

        data = rewrite()
        assert _pread(a, size) == data

        held = os.open(a, os.O_RDONLY)
        try:
            assert os.pread(held, size, 0) == data
            data = rewrite()
            assert _pread(a, size) == data
        finally:
            os.close(held)

        assert _pread(a, size) == data
        os.kill(pair.a.pid, signal.SIGSTOP)
        try:
            data = rewrite()
        finally:
            os.kill(pair.a.pid, signal.SIGCONT)
        assert _pread(a, size) == data
    finally:
        pair.stop()


def _listings_until_kept(pair: Pair, path: Path, expected: list[str], tries: int = 10) -> int:
    """List ``path`` until a listing costs mount A no readdir (the kernel
    kept it); the readdirs the last try cost (0 when kept)."""
    for _ in range(tries):
        before = pair.ops("readdir")
        assert sorted(os.listdir(path)) == expected
        sent = pair.ops("readdir") - before
        if not sent:
            return 0
        time.sleep(0.1)  # the first opendir under a lease empties the kernel's cache in the background
    return sent


def test_the_kernel_keeps_a_leased_listing_until_the_directory_changes(cluster, tmp_path: Path) -> None:
    """A listing of a directory A holds a lease on is kept by the kernel
    (FOPEN_CACHE_DIR): listed again, it costs A no readdir and no LoadDir.
    B's create, unlink and rename in it (revocations) and A's own show at once."""
    pair = Pair(cluster, tmp_path)
    try:
        a, b = pair.a.path / pair.name, pair.b.path / pair.name
        names = {f"f{i:03d}" for i in range(120)}  # several readdir pages
        for name in names:
            (b / name).write_bytes(b"x")
        assert _listings_until_kept(pair, a, sorted(names)) == 0
        readdirs, load_dirs = pair.ops("readdir"), pair.rpcs().get("load_dir", 0)
        for _ in range(3):
            assert sorted(os.listdir(a)) == sorted(names)
        assert (pair.ops("readdir"), pair.rpcs().get("load_dir", 0)) == (readdirs, load_dirs)

        (b / "new").write_bytes(b"n")
        os.unlink(b / "f000")
        os.rename(b / "f001", b / "g001")
        names = (names | {"new", "g001"}) - {"f000", "f001"}
        assert sorted(os.listdir(a)) == sorted(names)
        assert _listings_until_kept(pair, a, sorted(names)) == 0

        (a / "mine").write_bytes(b"m")
        os.unlink(a / "f002")
        names = (names | {"mine"}) - {"f002"}
        assert sorted(os.listdir(a)) == sorted(names)
        assert sorted(os.listdir(b)) == sorted(names)
    finally:
        pair.stop()
