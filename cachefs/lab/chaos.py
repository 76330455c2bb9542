"""The fault-injection matrix: inject each fault under load, then check every acknowledged change.

:class:`Chaos` starts a lab of real processes (:mod:`cachefs.lab.cluster`),
mounts its volume and, for each fault in the matrix, runs a
workload through the mount while the fault happens: files written and fsynced
(their sha256 logged once ``close`` returned: acknowledged), a metadata
workload of creates, renames and unlinks (each acknowledged result applied to
a model of the directory) and fio with ``verify=crc32c``. After each fault the
whole log so far is checked against the mount with the page cache dropped and
the client's L1 cache off, so reads reach the cache tier or backing storage.

Per fault: faults injected, operations acknowledged (during this fault),
operations verified (everything acknowledged so far), data lost (must be 0)
and the time until a probe (create, write, fsync, read back) succeeds again.
An operation that failed is not acknowledged and its names are left out of
the check ("uncertain"): a failed rename may still have committed.

The power cut moves every metanode's and datanode's data directory onto a
power-cut layer (:mod:`cachefs.testing.powercut`: a disk that forgets what
was not fsynced, file data and directory entries alike), kills every daemon
mid-workload, cuts the power of every disk at once, reboots, and checks.
A missing fsync anywhere on the write path shows up there as lost data.

The hostile peer (:mod:`cachefs.lab.hostile`) sends forged Raft traffic
over identities that are not the members it names; ``bench.chaos --json``
reports the messages every metanode refused and outlived
(``hostile_messages_survived``).

``python -m bench.chaos [--quick] [--json]`` runs the whole matrix; the
fault tests (tests/fault/) run the same scenarios on the quick lab.
"""

from __future__ import annotations

import collections
import errno
import functools
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio

from cachefs.commands import Mkdir
from cachefs.credentials import as_credential
from cachefs.errors import CacheFSError
from cachefs.lab import hostile, netns
from cachefs.lab.cluster import VOLUME, Lab, LabConfig, Node
from cachefs.metanode.raft.storage import WAL_NAME, record_spans
from cachefs.queries import ClusterMap
from cachefs.rpc import RpcPool
from cachefs.testing.powercut import PowerCutDisk

# ---------------------------------------------------------------- the workload


def _sha_of(path: Path) -> str:
    """sha256 of a file read through the mount, not the page cache."""
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        digest = hashlib.sha256()
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Check:
    verified: int = 0
    lost: list[str] = field(default_factory=list)


class Workload:
    """Writes and namespace changes through a mount, logging what was acknowledged.

    ``files`` maps a path under ``data/`` to the sha256 of its contents once
    write + fsync + close returned. ``names`` is the model of ``meta/``: name ->
    the content tag written into it, updated only after the syscall returned.
    A failed call makes the names it touched uncertain (it may have applied).
    """

    def __init__(self, mnt: Path, *, file_size: int = 256 << 10, fio_size: str = "2M", seed: int = 1) -> None:
        self.mnt = mnt
        self.file_size = file_size
        self.fio_size = fio_size
        self.rng = random.Random(seed)
        self.files: dict[str, str] = {}
        self.names: dict[str, str] = {}
        self.gone: set[str] = set()  # names whose unlink or rename-away was acknowledged
        self.uncertain: set[str] = set()
        self.fio_jobs: list[str] = []
        self.acked = 0
        self.failed = 0
        self.errnos: collections.Counter[str] = collections.Counter()  # errno names of the failed calls
        self._n = 0
        self._lock = threading.Lock()

    def paths(self) -> tuple[Path, Path, Path]:
        return self.mnt / "data", self.mnt / "meta", self.mnt / "fio"

    def prepare(self) -> None:
        for d in self.paths():
            d.mkdir(exist_ok=True)

    def _next(self) -> int:
        with self._lock:
            self._n += 1
            return self._n

    def write_file(self) -> None:
        name = f"f{self._next():05d}"
        data = self.rng.randbytes(self.file_size)
        try:
            with open(self.mnt / "data" / name, "wb") as f:
                f.write(data)
                os.fsync(f.fileno())
        except OSError as exc:
            self._failed(exc)
            self.uncertain.add("data/" + name)
            return
        self.files["data/" + name] = hashlib.sha256(data).hexdigest()
        self.acked += 1

    def meta_step(self) -> None:
        meta = self.mnt / "meta"
        live = sorted(set(self.names) - self.uncertain)
        op = self.rng.choice(["create", "create", "rename", "unlink"]) if live else "create"
        try:
            if op == "create":
                name = f"n{self._next():05d}"
                tag = f"{name}:{self.rng.getrandbits(32)}"
                with open(meta / name, "x") as f:
                    f.write(tag)
                    f.flush()
                    os.fsync(f.fileno())
                self.names[name] = tag
            elif op == "rename":
                old, new = self.rng.choice(live), f"r{self._next():05d}"
                try:
                    os.rename(meta / old, meta / new)
                except OSError:
                    self.uncertain.update((old, new))
                    raise
                self.names[new] = self.names.pop(old)
                self.gone.add(old)
            else:
                victim = self.rng.choice(live)
                try:
                    os.unlink(meta / victim)
                except OSError:
                    self.uncertain.add(victim)
                    raise
                del self.names[victim]
                self.gone.add(victim)
        except OSError as exc:
            self._failed(exc)
            if op == "create":
                self.uncertain.add(name)
            return
        self.acked += 1

    def _failed(self, exc: OSError) -> None:
        self.failed += 1
        self.errnos[errno.errorcode.get(exc.errno or 0, str(exc.errno))] += 1

    def fio_write(self, job: str, timeout: float = 120) -> bool:
        """One fio write job with crc32c verification; acknowledged when fio exits 0."""
        if shutil.which("fio") is None:
            return False
        try:
            ok = _fio(self.mnt / "fio", job, self.fio_size, verify_only=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            ok = False
        if ok:
            self.fio_jobs.append(job)
            self.acked += 1
        else:
            self.failed += 1
        return ok

    def run(self, stop: threading.Event, *, max_ops: int = 400, max_seconds: float = 60.0) -> None:
        """Alternate file writes and metadata steps until ``stop`` (bounded in count and time)."""
        end = time.monotonic() + max_seconds
        for i in range(max_ops):
            if stop.is_set() or time.monotonic() > end:
                return
            if i % 3 == 0:
                self.write_file()
            else:
                self.meta_step()

    def verify(self, *, namespace: bool = True) -> Check:
        """Check every acknowledged file, namespace change and fio job against the mount.

        ``namespace=False`` checks file contents only (safe while the workload runs).
        """
        check = Check()
        for rel, want in sorted(self.files.items()):
            try:
                got = _sha_of(self.mnt / rel)
            except OSError as exc:
                got = f"error {exc.errno}"
            if got == want:
                check.verified += 1
            else:
                check.lost.append(f"{rel}: {got}")
        if not namespace:
            return check
        meta = self.mnt / "meta"
        try:
            present = set(os.listdir(meta))
        except OSError as exc:
            check.lost.append(f"meta/: listdir failed ({exc})")
            return check
        for name, tag in sorted(self.names.items()):
            if name in self.uncertain:
                continue
            try:
                ok = (meta / name).read_text() == tag
            except OSError:
                ok = False
            if ok:
                check.verified += 1
            else:
                check.lost.append(f"meta/{name}: missing or wrong")
        for name in sorted(self.gone - set(self.names) - self.uncertain):
            if name in present:
                check.lost.append(f"meta/{name}: present, but its unlink or rename was acknowledged")
            else:
                check.verified += 1
        for extra in sorted(present - set(self.names) - self.gone - self.uncertain):
            check.lost.append(f"meta/{extra}: present, but never created")
        for job in self.fio_jobs:
            if _fio(self.mnt / "fio", job, self.fio_size, verify_only=True, timeout=120):
                check.verified += 1
            else:
                check.lost.append(f"fio job {job}: verify failed")
        return check


def _fio(directory: Path, job: str, size: str, *, verify_only: bool, timeout: float) -> bool:
    argv = ["fio", f"--name={job}", f"--directory={directory}", f"--size={size}", "--bs=256k", "--numjobs=1",
            "--rw=write", "--verify=crc32c", "--do_verify=1", "--end_fsync=1", "--invalidate=1",
            "--output-format=terse"]
    if verify_only:
        argv.append("--verify_only=1")
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout).returncode == 0


# ---------------------------------------------------------------- the lab under test


@dataclass
class Row:
    fault: str
    injected: int = 0
    acknowledged: int = 0
    verified: int = 0
    lost: int = 0
    recover_s: float | None = None
    note: str = ""
    lost_detail: list[str] = field(default_factory=list)


def quick_config(root: str, base_port: int) -> LabConfig:
    """3 metanodes, 3 datanodes (ec:2+1, M=1), 2 cache nodes with a small flash tier."""
    return LabConfig(root=root, metanodes=3, datanodes=3, cachenodes=2, zones=3, base_port=base_port,
                     policy="ec:2+1", metrics=False, data_capacity="4G", cache_capacity="8M",
                     cache_memory="0")


def full_config(root: str, base_port: int) -> LabConfig:
    """The lab's default shape: 3 metanodes, 6 datanodes (ec:4+2, M=2), 6 cache nodes."""
    return LabConfig(root=root, base_port=base_port, metrics=False, data_capacity="8G", cache_capacity="32M",
                     cache_memory="0")


class ChaosLab(Lab):
    """The lab, with metanodes that snapshot often (so snapshots exist to corrupt)."""

    snapshot_entries = 200

    def __init__(self, config: LabConfig) -> None:
        super().__init__(config)
        self.capacity: dict[str, int] = {}  # node name -> --capacity override in bytes (a "full disk")

    def _argv(self, node: Any) -> list[str]:
        argv = super()._argv(node)
        if node.kind == "metanode":
            argv += ["--snapshot-entries", str(self.snapshot_entries)]
        if node.name in self.capacity:
            argv[argv.index("--capacity") + 1] = str(self.capacity[node.name])
        return argv


class Chaos:
    """A lab, a mount and a workload, with the fault scenarios as methods."""

    def __init__(self, config: LabConfig, mountpoint: Path, *, quick: bool = True, seed: int = 1,
                 ops: int | None = None) -> None:
        self.lab = ChaosLab(config)
        self.mnt = mountpoint
        self.quick = quick
        self.rng = random.Random(seed)
        self.work = Workload(mountpoint, file_size=(128 << 10) if quick else (1 << 20),
                             fio_size="2M" if quick else "16M", seed=seed)
        self.m = int(config.policy.split("+")[1]) if config.policy.startswith("ec:") else 1
        self.rows: list[Row] = []
        self._ops = ops or (40 if quick else 200)  # workload operations per fault
        self._acked_before = 0
        self.packets_dropped = 0  # by the last packet_loss fault (nftables' counters)
        self.power_cuts = 0
        self.hostile_messages_survived = 0  # forged Raft messages refused with every metanode still up
        self._disks: dict[str, PowerCutDisk] = {}  # node name -> its power-cut layer, during power_cut

    # -- set-up

    def up(self) -> None:
        with _quiet_popen():
            self.lab.up(timeout=180)
        self.mount()
        self.work.prepare()

    def mount(self) -> None:
        self.lab.mount(str(self.mnt), "--l1-size", "0", "--attr-timeout", "0.2", "--entry-timeout", "0.2",
                       l2=False)  # reads must reach the cache tier and backing storage

    def down(self) -> None:
        with _quiet_popen():
            self.lab.down()
        for disk in self._disks.values():  # a power cut that broke half way
            disk.unmount()

    # -- helpers

    def meta_status(self) -> list[dict[str, Any]]:
        async def ask() -> list[dict[str, Any]]:
            out = []
            async with RpcPool(secret=self.lab.credential("admin")) as pool:
                for node in self.lab.of_kind("metanode"):
                    if not node.pid:
                        continue
                    try:
                        st = (await pool.call(node.addr, "meta_status", timeout=2)).result
                    except CacheFSError:
                        continue
                    out.append({**st, "name": node.name})
            return out

        return self.lab.run(ask)

    def leader(self, timeout: float = 60) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            leaders = [s["name"] for s in self.meta_status() if s["is_leader"]]
            if len(leaders) == 1:
                return leaders[0]
            time.sleep(0.2)
        raise RuntimeError("no metanode leader")

    def under_replicated(self) -> int:
        """Blocks in the repair queues of every volume (stored short, not yet repaired)."""
        from cachefs import queries as Q

        async def count() -> int:
            async with RpcPool(secret=self.lab.credential("admin")) as pool:
                meta = self.lab.meta_client(pool, deadline=10)
                volumes = await meta.query(Q.ListVolumes())
                return sum([len(await meta.query(Q.ListRepairs(v, 100_000))) for v in volumes])

        return self.lab.run(count)

    def settle_repairs(self, timeout: float = 120) -> int:
        """Wait (bounded) for the leader's repair service to drain every queue, with the
        cluster whole; returns what is left (``under_replicated_after_recovery``, must be 0)."""
        self.restart_dead()
        self._wait_datanodes_up()
        end = time.monotonic() + timeout
        while (left := self.under_replicated()) and time.monotonic() < end:
            time.sleep(0.5)
        return left

    def probe(self, timeout: float = 90, *, write: bool = True) -> float:
        """Seconds until create + write + fsync + read back succeeds through the mount.

        With ``write=False`` only reading an acknowledged file back (what an
        ec:K+M volume still promises below its write quorum of K+1).
        """
        start = time.monotonic()
        data = os.urandom(4096)
        while True:
            path = self.mnt / f"probe-{self.rng.getrandbits(40):010x}"
            try:
                if write:
                    with open(path, "wb") as f:
                        f.write(data)
                        os.fsync(f.fileno())
                    if _sha_of(path) == hashlib.sha256(data).hexdigest():
                        path.unlink()
                        return time.monotonic() - start
                else:
                    rel, want = next(iter(self.work.files.items()))
                    if _sha_of(self.mnt / rel) == want:
                        return time.monotonic() - start
            except OSError:
                pass
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"the mount did not recover within {timeout:.0f}s")
            time.sleep(0.2)

    @contextmanager
    def load(self, fio_job: str | None = None) -> Iterator[None]:
        """The workload (and one fio job) in background threads while the body injects a fault."""
        stop = threading.Event()
        threads = [threading.Thread(target=self.work.run, args=(stop,),
                                    kwargs={"max_ops": self._ops, "max_seconds": 60}, daemon=True)]
        if fio_job and shutil.which("fio"):
            threads.append(threading.Thread(target=self.work.fio_write, args=(fio_job,), daemon=True))
        for t in threads:
            t.start()
        try:
            yield
        finally:
            # Let the bounded workload finish its operations, then stop it.
            for t in threads:
                t.join(timeout=120)
            stop.set()
            for t in threads:
                t.join(timeout=60)

    def start(self, *names: str) -> None:
        with _quiet_popen():
            for name in names:
                self.lab.start(name)

    def restart_dead(self, kind: str | None = None) -> None:
        self.start(*[n.name for n in self.lab.nodes if n.pid is None and (kind is None or n.kind == kind)])

    def caches(self, up: bool) -> None:
        """Take the cache tier away (so reads reach backing storage) or bring it back."""
        for node in self.lab.of_kind("cachenode"):
            if up and node.pid is None:
                self.start(node.name)
            elif not up and node.pid is not None:
                self.lab.kill(node.name)

    def repair(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.admin_cli("repair", *extra)

    def admin_cli(self, command: str, *extra: str) -> subprocess.CompletedProcess[str]:
        """Run ``cachefs COMMAND`` against the lab with its admin credential."""
        argv = [sys.executable, "-m", "cachefs.cli", command, "--meta", ",".join(self.lab.meta_addrs),
                "--secret-file", str(self.lab.credential_file("admin")), *extra]
        if self.lab.config.netns:  # the lab's addresses are reachable from the client namespace only
            argv = self.lab.network.wrap(netns.CLIENT, argv)
        return subprocess.run(argv, capture_output=True, text=True, timeout=300)

    def record(self, fault: str, injected: int, recover_s: float | None, note: str = "") -> Row:
        check = self.work.verify()
        row = Row(fault, injected, self.work.acked - self._acked_before, check.verified, len(check.lost),
                  None if recover_s is None else round(recover_s, 2), note, check.lost[:10])
        self._acked_before = self.work.acked
        self.rows.append(row)
        return row

    # -- the scenarios

    def kill_leader(self) -> Row:
        leader = self.leader()
        with self.load("leader"):
            time.sleep(0.5)
            t0 = time.monotonic()
            self.lab.kill(leader)
            self.probe()
            recover = time.monotonic() - t0
        self.start(leader)
        return self.record("kill -9 metanode leader", 1, recover, f"{leader} was leader")

    def kill_follower(self) -> Row:
        leader = self.leader()
        follower = next(n.name for n in self.lab.of_kind("metanode") if n.name != leader)
        with self.load("follower"):
            time.sleep(0.5)
            t0 = time.monotonic()
            self.lab.kill(follower)
            self.probe()
            recover = time.monotonic() - t0
        self.start(follower)
        return self.record("kill -9 metanode follower", 1, recover)

    def kill_two_metanodes(self) -> Row:
        """Two of three gone: no write may be acknowledged; restart one and it goes on."""
        leader = self.leader()
        other = next(n.name for n in self.lab.of_kind("metanode") if n.name != leader)
        self.lab.kill(leader)
        self.lab.kill(other)
        refused = self.lab.run(self._write_refused)
        t0 = time.monotonic()
        self.start(leader, other)
        self.probe()
        recover = time.monotonic() - t0
        note = "writes refused without quorum" if refused else "A WRITE WAS ACCEPTED WITHOUT QUORUM"
        row = self.record("kill -9 two of three metanodes", 2, recover, note)
        if not refused:
            row.lost += 1
            row.lost_detail.append("mkdir acknowledged by a minority")
        return row

    async def _write_refused(self) -> bool:
        async with RpcPool(secret=self.lab.credential("admin")) as pool:
            meta = self.lab.meta_client(pool, deadline=4.0)
            try:
                name = b"no-quorum-" + os.urandom(4).hex().encode()
                await meta.mutate(Mkdir("lab", 1, name, 0o755))
            except CacheFSError:
                return True
            return False

    def restart_all_metanodes(self) -> Row:
        names = [n.name for n in self.lab.of_kind("metanode")]
        with self.load("allmeta"):
            time.sleep(0.5)
            t0 = time.monotonic()
            for name in names:
                self.lab.kill(name)
            self.start(*names)
            self.probe()
            recover = time.monotonic() - t0
        return self.record("kill -9 and restart all metanodes", len(names), recover)

    def kill_caches(self) -> Row:
        """Cache nodes killed one by one down to none; reads go on from backing storage."""
        names = [n.name for n in self.lab.of_kind("cachenode") if n.pid]
        worst = 0.0
        lost: list[str] = []
        with self.load("caches"):
            for name in names:
                t0 = time.monotonic()
                self.lab.kill(name)
                self.probe()
                worst = max(worst, time.monotonic() - t0)
                lost += self.work.verify(namespace=False).lost
        row = self.record("kill -9 cache nodes down to none", len(names), worst, "reads from backing storage")
        self.caches(up=True)
        row.lost += len(lost)
        row.lost_detail += lost[:10]
        return row

    def kill_m_datanodes(self) -> Row:
        self.caches(up=False)
        victims = [n.name for n in self.rng.sample(self.lab.of_kind("datanode"), self.m)]
        t0 = time.monotonic()
        for name in victims:
            self.lab.kill(name)
        self.probe(write=False)
        recover = time.monotonic() - t0
        row = self.record(f"kill -9 {self.m} datanode(s) (M), read everything", self.m, recover,
                          ",".join(victims) + " down: reads only (write quorum is K+1)")
        self.start(*victims)
        self._wait_datanodes_up()
        self.caches(up=True)
        return row

    def wipe_and_repair(self) -> Row:
        """One datanode's disk wiped; repair; then M other datanodes lost and everything still reads."""
        self.caches(up=False)
        victim = self.rng.choice(self.lab.of_kind("datanode"))
        t0 = time.monotonic()
        self.lab.kill(victim.name)
        shutil.rmtree(self.lab.root / victim.name)
        self.start(victim.name)
        self._wait_datanodes_up()
        result = self.repair("--json")
        passes = [result]
        while result.returncode != 0 and len(passes) < 3:  # a pass may race the restarted node; run again
            time.sleep(2)
            result = self.repair("--json")
            passes.append(result)
        recover = time.monotonic() - t0
        # Only a repaired cluster can lose M more datanodes; otherwise that loss is expected, not news.
        others = [n.name for n in self.lab.of_kind("datanode") if n.name != victim.name][: self.m]
        if result.returncode != 0:
            others = []
        for name in others:
            self.lab.kill(name)
        row = self.record("wipe a datanode's disk, repair, lose M others", 1 + len(others), recover,
                          f"repair exit {result.returncode} after {len(passes)} pass(es)")
        if result.returncode != 0 or len(passes) > 1:
            row.note += "; first pass: " + _summary(passes[0])
        self.start(*others)
        self._wait_datanodes_up()
        self.caches(up=True)
        return row

    def corrupt_shards(self, count: int = 12) -> Row:
        """Bit flips and truncations in one datanode's shard files (at most M shards of a block)."""
        if not self.work.files:  # run first, or alone: write something to damage
            with self.load():
                pass
        self.caches(up=False)
        victim = self.rng.choice(self.lab.of_kind("datanode"))
        files = sorted(p for p in (self.lab.root / victim.name / "shards").rglob("*")
                       if p.is_file() and not p.name.endswith(".corrupt"))
        chosen = self.rng.sample(files, min(count, len(files)))
        for i, path in enumerate(chosen):
            damage(path, self.rng, flip=i % 2 == 0)
        t0 = time.monotonic()
        self.probe()
        recover = time.monotonic() - t0
        row = self.record("corrupt shard files (bit flips, truncation)", len(chosen), recover,
                          f"{victim.name}: {len(chosen)} of {len(files)} shard files")
        result = self.repair("--scrub")
        row.note += f"; repair --scrub exit {result.returncode}"
        self.caches(up=True)
        return row

    def kill_client(self) -> Row:
        """kill -9 the FUSE client during writes, remount: everything acknowledged before is intact."""
        pids = mount_pids(self.mnt)
        with self.load():
            time.sleep(1.0)
            t0 = time.monotonic()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            _wait_gone(pid)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False, capture_output=True)
        self.lab.config.mountpoint = None
        self.mount()
        self.probe()
        recover = time.monotonic() - t0
        return self.record("kill -9 the FUSE client during writes, remount", len(pids), recover)

    def two_writer_compaction(self) -> Row:
        """Two mounts write one chunk (issue 14, item 1): the lab's mount makes
        64 fsynced 100-byte writes, so its compactor is due; in that window a
        second mount appends 4 KiB with O_APPEND and fsyncs, which the first
        mount's cached size does not know (and which makes the second mount's
        compactor due too: either may compact first, the other then finds one
        slice). After the compaction and a GC with no grace, every byte of
        both writers reads back. The stale-size case alone, deterministically:
        ``tests/client/test_readwrite.py``."""
        other = self.mnt.parent / f"{self.mnt.name}-second"
        logs = [self.lab.log_path("mount"), self.lab.log_path("second-mount")]

        def compactions() -> int:  # by either mount: the one that gets there first compacts
            return sum(p.read_text(errors="replace").count("compacted chunk 0 ") for p in logs if p.exists())

        seen = compactions()
        self.lab.mount(str(other), "--l1-size", "0", l2=False, name="second-mount")
        rel = f"data/two-writers-{len(self.rows):02d}"
        parts = [self.rng.randbytes(100) for _ in range(64)]
        tail = self.rng.randbytes(4096)
        t0 = time.monotonic()
        try:
            with open(self.mnt / rel, "wb") as f:
                for part in parts:
                    f.write(part)
                    f.flush()
                    os.fsync(f.fileno())
                with open(other / rel, "ab") as g:  # opened on the second mount: it sees the 6,400 bytes
                    g.write(tail)
                    g.flush()
                    os.fsync(g.fileno())
            deadline = time.monotonic() + 60
            while compactions() == seen:
                if time.monotonic() > deadline:
                    raise CacheFSError(f"neither mount compacted {rel} (see {logs[0]} and {logs[1]})")
                time.sleep(0.2)
        finally:
            subprocess.run([sys.executable, "-m", "cachefs.cli", "umount", str(other)],
                           capture_output=True, timeout=120, check=False)
            if other.is_mount():
                subprocess.run(["fusermount3", "-u", "-z", str(other)], capture_output=True, check=False)
            if not other.is_mount():  # the lab made the mount point: leave no empty one behind
                with suppress(OSError):
                    other.rmdir()
        self.work.files[rel] = hashlib.sha256(b"".join(parts) + tail).hexdigest()
        self.work.acked += 2
        gc = self.admin_cli("gc", "--volume", VOLUME, "--grace", "0", "--delete")
        if gc.returncode != 0:
            raise CacheFSError(f"cachefs gc failed: {_summary(gc)}")
        return self.record("two mounts on one chunk: compaction while the other appends, then GC", 1,
                           time.monotonic() - t0)

    def fill_cache(self) -> Row:
        """Read more than the cache tier holds: caches full, evicting, reads still right."""
        self.caches(up=True)
        names = [n.name for n in self.lab.of_kind("cachenode")]
        t0 = time.monotonic()
        self.work.verify()  # reads everything through the (small) cache tier
        stats = self.lab.run(self._cache_stats)
        full = sum(1 for s in stats if s.get("used", 0) > 0.5 * s.get("capacity", 1))
        over = [s for s in stats if s.get("used", 0) > s.get("capacity", 0)]
        row = self.record("fill the cache nodes' flash", len(names), time.monotonic() - t0,
                          f"{full}/{len(stats)} caches over half full")
        if over:
            row.lost += len(over)
            row.lost_detail.append(f"cache over capacity: {over}")
        return row

    async def _cache_stats(self) -> list[dict[str, Any]]:
        out = []
        async with RpcPool(secret=self.lab.credential("admin")) as pool:
            for node in self.lab.of_kind("cachenode"):
                if node.pid:
                    out.append((await pool.call(node.addr, "stats", timeout=5)).result)
        return out

    def _wait_datanodes_up(self, timeout: float = 60) -> None:
        """Until every running datanode answers and the cluster map shows them all up.

        The map alone is not enough: a datanode killed and restarted within the
        node timeout still shows "up" while its new process is starting.
        """

        async def wait() -> None:
            async with RpcPool(secret=self.lab.credential("admin")) as pool:
                meta = self.lab.meta_client(pool, deadline=10)
                with trio.fail_after(timeout):
                    for node in self.lab.of_kind("datanode"):
                        while node.pid:
                            try:
                                await pool.call(node.addr, "health", timeout=2)
                                break
                            except CacheFSError:
                                pool.forget(node.addr)
                                await trio.sleep(0.2)
                    while True:
                        cmap = await meta.query(ClusterMap())
                        if all(n["state"] == "up" for n in cmap["datanodes"]):
                            return
                        await trio.sleep(0.2)

        self.lab.run(wait)

    def fill_datanode(self) -> Row:
        """One datanode's disk full (its capacity cut to what it holds): writes go on or fail
        cleanly (ENOSPC), nothing acknowledged is lost; given room again, it takes writes."""
        victim = self.rng.choice(self.lab.of_kind("datanode")).name
        held = sum(p.stat().st_size for p in (self.lab.root / victim / "shards").rglob("*") if p.is_file())
        self.lab.capacity[victim] = held + (256 << 10)
        self.lab.kill(victim)
        self.start(victim)
        self._wait_datanodes_up()
        failed_before = self.work.failed
        errnos_before = collections.Counter(self.work.errnos)
        with self.load("fulldisk"):
            pass
        errnos = self.work.errnos - errnos_before
        t0 = time.monotonic()
        self.probe()
        recover = time.monotonic() - t0
        refused = self.work.failed - failed_before
        del self.lab.capacity[victim]
        self.lab.kill(victim)
        self.start(victim)
        self._wait_datanodes_up()
        return self.record("fill a datanode's disk", 1, recover,
                           f"{victim} full at {held >> 20} MiB; {refused} operations refused "
                           f"({', '.join(f'{k} x{v}' for k, v in sorted(errnos.items())) or '-'})")

    # -- power loss

    def power_cut(self) -> Row:
        """Power lost on every server at once mid-workload: everything acknowledged is on disk.

        The metanodes' and datanodes' data directories move onto power-cut
        layers first (a kill -9 and a restart). Once the workload has had
        writes and namespace changes acknowledged on them, every daemon is
        killed and every disk loses what was not fsynced; then the disks and
        daemons come back (the client mount stays, as a training node on
        other power would) and everything acknowledged so far is checked.
        Afterwards the data directories go back to plain disks.
        """
        names = [n.name for n in self.lab.nodes if n.kind in ("metanode", "datanode")]
        try:
            self._onto_power_cut_disks(names)
            acked, files = self.work.acked, len(self.work.files)
            with self.load("powercut"):
                self._wait_files(files + 3)
                on_disks = self.work.acked - acked
                t0 = time.monotonic()
                daemons = [n.name for n in self.lab.nodes if n.pid]
                for name in daemons:
                    self.lab.kill(name)
                for disk in self._disks.values():
                    disk.cut()
                self._boot_disks()
                self.restart_dead()
                self.probe()
                recover = time.monotonic() - t0
            self.power_cuts += 1
            return self.record("power cut on every server mid-workload", len(daemons), recover,
                               f"{len(daemons)} daemons, {len(self._disks)} disks cut after {on_disks} "
                               "operations acknowledged on them")
        finally:
            self._off_power_cut_disks()

    def _wait_files(self, count: int, timeout: float = 60) -> None:
        """Until the workload has ``count`` files acknowledged (written, fsynced, closed)."""
        end = time.monotonic() + timeout
        while len(self.work.files) < count:
            if time.monotonic() > end:
                raise RuntimeError(f"the workload had {len(self.work.files)} of {count} files "
                                   f"acknowledged after {timeout:.0f}s")
            time.sleep(0.05)

    def _boot_disks(self) -> None:
        for disk in self._disks.values():
            disk.start()
        for disk in self._disks.values():
            disk.wait()

    def _wait_cluster(self, timeout: float = 90) -> None:
        self.leader(timeout)
        self._wait_datanodes_up(timeout)

    def _onto_power_cut_disks(self, names: list[str]) -> None:
        """Stop ``names`` and restart them with their data directory on a power-cut layer
        (backed by ``ROOT/disks/NAME``, which adopts the directory as it is)."""
        for name in names:
            self.lab.kill(name)
        for name in names:
            data, backing = self.lab.root / name, self.lab.root / "disks" / name
            backing.mkdir(parents=True)
            os.rename(data, backing / "tree")
            data.mkdir()
            self._disks[name] = PowerCutDisk(backing, data, self.lab.root / "logs" / f"{name}-disk.log")
        self._boot_disks()
        self.start(*names)
        self._wait_cluster()

    def _off_power_cut_disks(self) -> None:
        """Back onto plain data directories: stop, unmount (a clean shutdown), move back, restart."""
        for name in self._disks:
            self.lab.kill(name)
        for name, disk in list(self._disks.items()):
            disk.unmount()
            data = self.lab.root / name
            data.rmdir()
            os.rename(disk.tree, data)
            shutil.rmtree(disk.backing)  # the layer's own hard links to the same files
            del self._disks[name]
        self.restart_dead()
        self._wait_cluster()

    # -- on-disk corruption

    def replace_metanode(self) -> Row:
        """``cachefs metanode replace`` of a follower by a new metanode with an
        empty disk, while the workload runs; the leader is killed -9 while
        the new one is still a learner. The change goes on under the next
        leader (the learner is promoted once caught up, then the old one is
        removed), and nothing acknowledged is lost.

        The new metanode starts only after the kill: running, it can catch
        up and be promoted between two polls of ``meta_status``, and the
        kill would then miss the learner stage it is meant to hit."""
        leader = self.leader()
        old = self._follower()
        old_id = int(old.removeprefix("meta"))
        new_id = max(int(n.name.removeprefix("meta")) for n in self.lab.of_kind("metanode")) + 1
        base = min(n.port for n in self.lab.of_kind("metanode")) - 1
        new = Node(f"meta{new_id}", "metanode", f"127.0.0.1:{base + new_id}", zone="z1", join=True)
        self.lab.nodes.append(new)
        self.lab.save()
        argv = [sys.executable, "-m", "cachefs.cli", "metanode", "replace", str(old_id), new.addr,
                "--id", str(new_id), "--timeout", "120", "--json", "--meta",
                ",".join(self.lab.meta_addrs), "--secret-file",
                str(self.lab.credential_file("admin"))]
        with self.load("replace"):
            time.sleep(0.5)
            t0 = time.monotonic()
            with _quiet_popen():
                cli = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
            try:
                end = time.monotonic() + 60
                while not any(str(new_id) in s.get("learners", {}) for s in self.meta_status()):
                    if time.monotonic() > end or cli.poll() is not None:
                        if cli.poll() is None:
                            cli.kill()
                        _, err = cli.communicate()
                        raise RuntimeError(f"metanode {new_id} never became a learner: "
                                           f"{err.strip()[-2000:]}")
                    time.sleep(0.05)
                self.lab.kill(leader)  # kill -9 in the middle of the change
                self.start(new.name)  # it catches up from the next leader
                out, err = cli.communicate(timeout=240)
            finally:
                if cli.poll() is None:
                    cli.kill()
                    cli.communicate()
            if cli.returncode != 0:
                raise RuntimeError(f"metanode replace failed ({cli.returncode}): {err.strip()}")
            self.start(leader)
            self.probe()
            recover = time.monotonic() - t0
        members = json.loads(out)
        self.lab.kill(old)  # removed: stop it, and forget it
        self.lab.nodes.remove(self.lab.node(old))
        self.lab.save()
        voters = sorted(int(i) for i in members["voters"])
        if old_id in voters or new_id not in voters or len(voters) != 3:
            raise RuntimeError(f"after replacing {old_id} by {new_id}: voters {voters}")
        self._wait_caught_up(new.name)
        return self.record("replace a metanode (leader killed -9 meanwhile)", 2, recover,
                           f"{old} -> {new.name}, {leader} killed")

    def _follower(self) -> str:
        leader = self.leader()
        return next(n.name for n in self.lab.of_kind("metanode") if n.name != leader)

    def _wait_caught_up(self, name: str, timeout: float = 60) -> None:
        """Until ``name`` has applied everything the leader had committed when we started waiting."""
        end = time.monotonic() + timeout
        target = None
        status: dict[str, Any] = {}
        while time.monotonic() < end:
            status = {s["name"]: s for s in self.meta_status()}
            leader = next((s for s in status.values() if s["is_leader"]), None)
            if target is None and leader:
                target = leader["commit_index"]
            if target is not None and name in status and status[name]["applied_index"] >= target:
                return
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not catch up to {target} within {timeout:.0f}s: {status}")

    def _log(self, name: str) -> str:
        return (self.lab.root / "logs" / f"{name}.log").read_text(errors="replace")

    def _start_refused(self, name: str, timeout: float = 30) -> bool:
        """Start ``name``: True if it refused to start (exited; then recorded as stopped), False
        once it answers ``meta_status``."""
        self.start(name)
        deadline = time.monotonic() + timeout
        pid = self.lab.node(name).pid
        while time.monotonic() < deadline:
            try:
                waited, _ = os.waitpid(pid, os.WNOHANG)  # type: ignore[arg-type]
            except ChildProcessError:
                waited = pid
            if waited == pid:
                self.lab.kill(name)  # records it as stopped
                return True
            if any(s["name"] == name for s in self.meta_status()):
                return False
            time.sleep(0.2)
        return False

    def _lose_leader_check(self) -> Check:
        """With the repaired replica in the majority: kill the leader, check, restart it."""
        leader = self.leader()
        self.lab.kill(leader)
        self.probe()
        check = self.work.verify()
        self.start(leader)
        return check

    def corrupt_wal_tail(self) -> Row:
        """A follower's WAL: last record bit-flipped and garbage appended (a torn, rotten tail)."""
        victim = self._follower()
        with self.load("waltail"):
            pass
        self.lab.kill(victim)
        wal = self.lab.root / victim / "wal.log"
        size = wal.stat().st_size
        with open(wal, "r+b") as f:
            f.seek(max(0, size - 3))
            last = f.read(1)
            f.seek(max(0, size - 3))
            f.write(bytes([last[0] ^ 0x40]))
            f.seek(0, os.SEEK_END)
            f.write(os.urandom(37))
        t0 = time.monotonic()
        self.start(victim)
        self._wait_caught_up(victim)
        recover = time.monotonic() - t0
        log = (self.lab.root / "logs" / f"{victim}.log").read_text(errors="replace")
        reported = "cutting" in log
        row = self.record("corrupt a follower's WAL tail, then lose the leader", 2, recover,
                          "tail cut and reported" if reported else "CORRUPTION NOT REPORTED")
        extra = self._lose_leader_check()
        row.lost += len(extra.lost) + (0 if reported else 1)
        row.lost_detail += extra.lost[:10]
        return row

    def corrupt_snapshot(self) -> Row:
        """A follower's newest snapshot bit-flipped: it must refuse it loudly; wiped, it is rebuilt."""
        victim = self._follower()
        snaps: list[Path] = []
        for i in range(12):  # until every replica has taken a snapshot (bounded)
            if snaps:
                break
            with self.load(f"snap{i}"):
                pass
            snaps = sorted((self.lab.root / victim).glob("snap-*.snap"))
        if not snaps:
            return self.record("corrupt a follower's snapshot", 0, None, "no snapshot was taken: not run")
        self.lab.kill(victim)
        data = bytearray(snaps[-1].read_bytes())
        data[len(data) // 2] ^= 0x01
        snaps[-1].write_bytes(bytes(data))
        t0 = time.monotonic()
        refused = self._start_refused(victim)  # else it came up: it must not serve the corrupt state (below)
        log = self._log(victim)
        if refused:
            note = "refused to start: " + ("snapshot named" if "snapshot" in log.lower() else "NO CLEAR MESSAGE")
            shutil.rmtree(self.lab.root / victim)  # the operator's fix: rebuild from the others
            self.start(victim)
        else:
            note = "came up"
        # An empty replica is only sent the leader's snapshot once a new entry is
        # replicated (an idle leader's heartbeats do not probe its log): write.
        with self.load("snapfix"):
            pass
        try:
            self._wait_caught_up(victim)
        except RuntimeError as exc:  # a finding, not a crash of the matrix: the replica stays empty
            row = self.record("corrupt a follower's snapshot, then lose the leader", 1, None,
                              note + f"; REBUILT REPLICA NEVER CAUGHT UP ({str(exc)[:60]})")
            row.lost_detail.append("rebuilt replica never caught up (not data loss: 2 of 3 replicas serve)")
            return row
        recover = time.monotonic() - t0
        row = self.record("corrupt a follower's snapshot, then lose the leader", 2, recover, note)
        extra = self._lose_leader_check()
        row.lost += len(extra.lost) + (1 if "NO CLEAR" in note else 0)
        row.lost_detail += extra.lost[:10]
        return row

    def corrupt_wal_middle(self) -> Row:
        """A bit flipped in a follower's WAL record that has whole records after it: not a torn
        tail, so start-up must refuse it, naming the file and the offset, rather than cut what
        the replica acknowledged. The operator's way back (docs/raft.md): move the data directory
        aside and start the replica empty; it rebuilds from its peers."""
        fault = "corrupt a record mid-WAL on a follower, rebuild it, then lose the leader"
        victim = self._follower()
        wal = self.lab.root / victim / WAL_NAME
        for i in range(12):  # until its WAL holds records after the damaged one (bounded)
            with self.load(f"walmid{i}"):
                pass
            if len(record_spans(wal.read_bytes())) >= 4:
                break
        self.lab.kill(victim)
        raw = bytearray(wal.read_bytes())
        spans = record_spans(bytes(raw))
        if len(spans) < 4:
            return self.record(fault, 0, None, f"the WAL held only {len(spans)} records: not run")
        at, size = spans[-3]  # two whole records after it; never BASE (the first)
        raw[at + size // 2] ^= 0x10  # past the length field: the CRC no longer matches
        wal.write_bytes(bytes(raw))
        t0 = time.monotonic()
        refused = self._start_refused(victim)
        log = self._log(victim)
        named = f"CRC mismatch at byte {at}" in log and str(wal) in log
        note = ("refused to start, file and offset named" if refused and named else
                "refused to start: NO CLEAR MESSAGE" if refused else "CAME UP ON A DAMAGED WAL")
        if refused:
            aside = self.lab.root / f"{victim}.damaged"
            shutil.rmtree(aside, ignore_errors=True)  # an earlier run's
            (self.lab.root / victim).rename(aside)  # kept for a post-mortem, as the procedure says
            self.start(victim)
        with self.load("walmidfix"):  # entries to replicate: the leader finds the empty replica
            pass
        try:
            self._wait_caught_up(victim)
        except RuntimeError as exc:
            row = self.record(fault, 1, None, note + f"; REBUILT REPLICA NEVER CAUGHT UP ({str(exc)[:60]})")
            row.lost_detail.append("rebuilt replica never caught up")
            return row
        row = self.record(fault, 2, time.monotonic() - t0, note)
        extra = self._lose_leader_check()  # the rebuilt replica is in the majority now
        row.lost += len(extra.lost) + (0 if refused and named else 1)
        row.lost_detail += extra.lost[:10] + ([] if refused and named else [note])
        return row

    def hostile_peer(self, rounds: int = 20) -> Row:
        """Forged Raft traffic (:mod:`cachefs.lab.hostile`: well-formed messages of every kind and
        snapshot transfers) at every metanode while the workload runs, over identities that are
        not the members the messages name (the cluster secret's, a datanode's, the lab's admin
        and client credentials): each refused, every metanode still up, nobody deposed, nothing
        lost."""
        metanodes = [n.name for n in self.lab.of_kind("metanode")]
        end = time.monotonic() + 60
        while len(status := {s["name"]: s for s in self.meta_status()}) < len(metanodes):  # all serving
            if time.monotonic() > end:
                raise RuntimeError(f"metanodes not all serving: {sorted(status)}")
            time.sleep(0.2)
        leader = self.leader()
        term = status[leader]["term"]
        forger = hostile.Forger(self.rng, tuple(sorted(s["id"] for s in status.values())), term,
                                status[leader]["commit_index"])
        secret = self.lab.secret
        identities = [as_credential(secret), as_credential(secret, "datanode-1"), self.lab.credential("admin"),
                      self.lab.credential("client")]
        logged = {n: self._log(n).count("refused a") for n in metanodes}  # refusals are logged (rate-limited)
        storm = functools.partial(hostile.storm, self.lab.meta_addrs, identities, forger, rounds=rounds,
                                  tls=self.lab.client_tls())
        with self.load("hostile"):
            t0 = time.monotonic()
            report = self.lab.run(storm)
            self.probe()
            recover = time.monotonic() - t0
        down = [n for n in metanodes if n not in self.lab.running()]
        after = {s["name"]: s for s in self.meta_status()}
        deposed = after.get(leader, {}).get("is_leader") is not True or after[leader]["term"] != term
        refused = all(self._log(n).count("refused a") > logged[n] for n in metanodes)
        problems = ([f"METANODES DOWN: {', '.join(down)}"] if down else []) + \
            (["LEADER DEPOSED"] if deposed else []) + ([] if refused else ["REFUSALS NOT LOGGED"]) + \
            ([f"{report.unexpected} CALLS FAILED UNREFUSED"] if report.unexpected else [])
        errors = ", ".join(f"{n} {name}" for name, n in sorted(report.errors.items()))
        note = f"{report.messages} forged messages in {report.calls} calls (errors: {errors}; the rest " \
               f"answered, their messages refused and counted)" + "".join(f"; {p}" for p in problems)
        row = self.record("hostile peer: forged Raft messages from non-members", report.messages, recover, note)
        row.lost += len(problems)
        row.lost_detail += problems
        if down:
            self.restart_dead("metanode")
        else:
            self.hostile_messages_survived += report.messages
        return row

    def corrupt_cache_files(self, count: int = 12) -> Row:
        """Bit flips and truncations in cache nodes' block files: detected, refetched, never served."""
        self.caches(up=True)
        self.work.verify()  # fill the caches
        files = sorted(p for node in self.lab.of_kind("cachenode")
                       for p in (self.lab.root / node.name / "blocks").rglob("*") if p.is_file())
        chosen = self.rng.sample(files, min(count, len(files)))
        for i, path in enumerate(chosen):
            damage(path, self.rng, flip=i % 2 == 0)
        t0 = time.monotonic()
        row = self.record("corrupt cache block files (bit flips, truncation)", len(chosen), None,
                          f"{len(chosen)} of {len(files)} cached blocks")
        row.recover_s = round(time.monotonic() - t0, 2)
        # Restarted, a cache node rebuilds its index by scanning: still never wrong.
        for node in self.lab.of_kind("cachenode"):
            self.lab.kill(node.name)
        self.caches(up=True)
        extra = self.work.verify()
        row.lost += len(extra.lost)
        row.lost_detail += extra.lost[:10]
        return row

    # -- network faults (a --netns lab: every daemon in its own network namespace)

    def partition_leader(self) -> Row:
        """The metanode leader cut off the bridge: a new leader takes over; heal, it rejoins."""
        leader = self.leader()
        net = self.lab.network
        with self.load("cutleader"):
            time.sleep(0.5)
            t0 = time.monotonic()
            net.cut(leader)
            try:
                self.probe()
                recover = time.monotonic() - t0
            finally:
                time.sleep(2)
                net.heal(leader)
        self._wait_caught_up(leader)
        return self.record("partition the metanode leader", 1, recover, f"{leader} cut, then healed")

    def partition_zone(self, zone: str = "z3") -> Row:
        """Every daemon of one zone cut off (its metanode, datanodes and cache nodes)."""
        net = self.lab.network
        with self.load("cutzone"):
            time.sleep(0.5)
            t0 = time.monotonic()
            cut = net.cut(zone)
            note = ", ".join(cut)
            try:
                try:
                    self.probe(timeout=10)
                except RuntimeError:  # too few datanodes left for the write quorum: reads must go on
                    self.probe(write=False)
                    note += "; writes refused (too few datanodes outside the zone)"
                recover = time.monotonic() - t0
            finally:
                time.sleep(2)
                net.heal(zone)
        self._wait_datanodes_up()
        return self.record(f"partition zone {zone}", len(cut), recover, note)

    def packet_loss(self, percent: float = 5) -> Row:
        """``percent`` % of the packets dropped each way on every link of the bridge (every daemon's
        and the client's; nftables, :mod:`cachefs.lab.netns`) while the workload and fio run.

        Everything acknowledged so far is checked twice: with the loss still on
        (reads cross the lossy links too) and after heal. Recovery: from the
        loss going on until a probe write succeeds through it.
        """
        fault = f"drop {percent:g}% of packets on all links"
        reason = netns.loss_supported()
        if reason:  # say so rather than pretend
            return self.record(fault, 0, None, f"not run: {reason}")
        net = self.lab.network
        failed_before = self.work.failed
        try:
            t0 = time.monotonic()
            net.set_loss(percent, netns.ALL)
            with self.load("loss"):
                self.probe()
                recover = time.monotonic() - t0
            during = self.work.verify()
            self.packets_dropped = sum(net.dropped().values())
        finally:
            net.heal(netns.ALL)
        row = self.record(fault, len(net.endpoints), recover,
                          f"{self.packets_dropped} packets dropped; {during.verified} verified under loss; "
                          f"{self.work.failed - failed_before} operations failed")
        row.lost += len(during.lost)
        row.lost_detail += during.lost[:10]
        return row

    def scenarios(self) -> list[Callable[[], Row]]:
        return [self.kill_leader, self.kill_follower, self.kill_two_metanodes, self.restart_all_metanodes,
                self.kill_caches, self.kill_m_datanodes, self.wipe_and_repair, self.corrupt_shards,
                self.kill_client, self.two_writer_compaction, self.fill_cache, self.fill_datanode, self.power_cut, self.corrupt_wal_tail,
                self.corrupt_snapshot, self.corrupt_wal_middle, self.hostile_peer, self.corrupt_cache_files,
                # the new metanode is planned on 127.0.0.1, outside the namespaces
                *([] if self.lab.config.netns else [self.replace_metanode]),
                *([self.partition_leader, self.partition_zone, self.packet_loss] if self.lab.config.netns else [])]


def damage(path: Path, rng: random.Random, *, flip: bool) -> None:
    """Flip one random bit of ``path``, or truncate it at a random length."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if flip and size:
            pos = rng.randrange(size)
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        else:
            f.truncate(rng.randrange(size) if size else 0)


def _summary(result: subprocess.CompletedProcess[str]) -> str:
    """The repair report's counters (its --json output), or its last line."""
    try:
        report = json.loads(result.stdout)
    except ValueError:
        return (result.stderr or result.stdout).strip().splitlines()[-1][:200]
    return json.dumps(report)[:400]


def mount_pids(mnt: Path) -> list[int]:
    """PIDs of the ``cachefs mount`` processes serving ``mnt`` (by their command line)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mount" in argv and str(mnt).encode() in argv and any(a.endswith(b"cachefs.cli") for a in argv):
            pids.append(int(proc.name))
    return pids


def _wait_gone(pid: int, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@contextmanager
def _quiet_popen() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        yield


def totals(rows: list[Row]) -> dict[str, Any]:
    return {
        "faults_injected": sum(r.injected for r in rows),
        "acknowledged": sum(r.acknowledged for r in rows),
        "data_lost": sum(r.lost for r in rows),
        "rows": [asdict(r) for r in rows],
    }


@contextmanager
def running_chaos(root: Path, *, seed: int, netns_subnet: str = "", ops: int = 15) -> Iterator[Chaos]:
    """A quick Chaos lab on free ports, up and mounted, with a short workload of ``ops``
    operations per fault (``bench.chaos`` runs the long one); torn down and its mount
    point removed afterwards."""
    from cachefs.testing.ports import free_lab_base

    mnt = Path(tempfile.mkdtemp(prefix="cachefs-fault-mnt-"))
    config = quick_config(str(root), 0)
    config.netns = netns_subnet
    config.base_port = free_lab_base(config)
    c = Chaos(config, mnt, quick=True, seed=seed, ops=ops)
    try:
        c.up()
        yield c
    finally:
        c.down()
        if not mnt.is_mount():
            shutil.rmtree(mnt, ignore_errors=True)
