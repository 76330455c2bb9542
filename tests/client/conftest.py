"""Mount fixtures for the client tests.

``localmount`` starts ``tests.client.localfs`` (the real FUSE client over an
in-process metadata state machine) in its own process; tests do plain
syscalls against the mount point, as applications do. A mount's log must end
without errors or tracebacks: a handler that hit something unexpected fails
the test that caused it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.testing.labs import running_lab
from cachefs.testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]
# The metadata lease term of ``cluster`` (the metanodes' default is 8 s): what
# a frozen mount can delay another's change by, so the tests that wait one
# out wait this long; still far longer than the mounts' 0.5 s attribute and
# entry timeouts, so what they answer from memory is answered under a lease.
LEASE_TERM = 3.0


def mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    return any(
        line.split()[4] == real for line in Path("/proc/self/mountinfo").read_text().splitlines()
    )


class LocalMount:
    """One ``tests.client.localfs`` process and its mount point."""

    def __init__(self, root: Path, *args: str) -> None:
        self.root = root
        # Under /tmp itself, so that other users (the permission tests) can reach it.
        self.path = Path(tempfile.mkdtemp(prefix="cachefs-mnt-"))
        self.path.chmod(0o755)
        self.log_path = root / "mount.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.client.localfs", str(self.path), *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.stop()
            raise RuntimeError(f"localfs did not mount: {line!r}\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False)
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        deadline = time.monotonic() + 10
        while mounted(self.path) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not mounted(self.path):
            self.path.rmdir()
        return self.proc.returncode

    def check_log(self) -> None:
        text = self.log()
        bad = [
            line
            for line in text.splitlines()
            if line.startswith(("ERROR", "CRITICAL", "Traceback"))
        ]
        assert not bad, text


@pytest.fixture
def localmount(needs_fuse, tmp_path: Path) -> Iterator[LocalMount]:
    m = LocalMount(tmp_path)
    try:
        yield m
    finally:
        status = m.stop()
    assert status == 0, m.log()
    m.check_log()


@pytest.fixture
def mnt(localmount: LocalMount) -> Path:
    return localmount.path


@pytest.fixture(scope="module")
def module_mnt(needs_fuse, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One ``localmount`` for a whole module whose tests each use names of
    their own (a mount costs a process start; its log is checked at the end)."""
    m = LocalMount(tmp_path_factory.mktemp("mount"))
    try:
        yield m.path
    finally:
        status = m.stop()
    assert status == 0, m.log()
    m.check_log()


@pytest.fixture
def mnt_dir(module_mnt: Path, request: pytest.FixtureRequest) -> Path:
    """A directory of its own for each test, on ``module_mnt`` (a mount of
    its own costs a test 2 to 5 s of process start and stop)."""
    d = module_mnt / request.node.name.translate(str.maketrans("[]/ ", "__--"))
    d.mkdir()
    d.chmod(0o755)  # tests that act as another user walk through it
    return d


# ---------------------------------------------------------------- a real cluster


class ClusterMount:
    """``cachefs mount -d`` of the cluster's volume; ``stop`` is ``cachefs umount``."""

    def __init__(self, lab, root: Path, *extra: str, path: Path | None = None) -> None:
        self.lab = lab
        self.path = path or Path(tempfile.mkdtemp(prefix="cachefs-mnt-"))
        self.path.chmod(0o755)
        self.log_path = root / f"mount-{self.path.name}.log"
        argv = [sys.executable, "-m", "cachefs.cli", "mount", ",".join(lab.meta_addrs), "lab", str(self.path),
                "-d", "--secret-file", str(lab.secret_file), "--log-file", str(self.log_path), "--zone", "z1",
                "--attr-timeout", "0.5", "--entry-timeout", "0.5", *extra]  # fmt: skip
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"mount failed: {proc.stderr}\n{self.log()}")
        self.pid = int(proc.stdout.split("pid ")[1].rstrip(")\n"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if mounted(self.path):
            proc = subprocess.run([sys.executable, "-m", "cachefs.cli", "umount", str(self.path)], cwd=REPO,
                                  capture_output=True, text=True, timeout=180)  # fmt: skip
            if proc.returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False)
                raise RuntimeError(f"umount failed: {proc.stderr}\n{self.log()}")
        if not mounted(self.path):
            self.path.rmdir()

    def check_log(self) -> None:
        bad = [line for line in self.log().splitlines() if " ERROR " in line or line.startswith("Traceback")]
        assert not bad, self.log()


@pytest.fixture(scope="session")
def cluster(needs_fuse, tmp_path_factory):
    """A cluster of real processes (3 metanodes, 3 datanodes, 2 cache nodes; ec:2+1; leases of LEASE_TERM)."""

    with running_lab(tmp_path_factory.mktemp("cluster"), metanodes=3, cachenodes=2, data_capacity="8G",
                     cache_capacity="2G", cache_memory="32M",
                     metanode_options=["--lease-term", str(LEASE_TERM)]) as lab:  # fmt: skip
        yield lab


@pytest.fixture
def cluster_mount(cluster, tmp_path: Path) -> Iterator[ClusterMount]:
    m = ClusterMount(cluster, tmp_path)
    try:
        yield m
    finally:
        m.stop()
    m.check_log()


def mount_metrics(port: int) -> str:
    """The text of a mount's metrics endpoint."""
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def mount_ops(port: int) -> dict[str, int]:
    """FUSE requests a mount answered so far, by op."""
    found = re.findall(r'^cachefs_mount_op_latency_seconds_count\{op="(\w+)"\} (\S+)$', mount_metrics(port), re.M)
    return {op: int(float(n)) for op, n in found}


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counts that grew from ``before`` to ``after``, by how much."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


@pytest.fixture
def metered(needs_fuse, tmp_path: Path):
    """A localfs mount with its metrics on a port: ``(mount, port)``."""
    port = free_port()
    m = LocalMount(tmp_path, "--metrics-port", str(port))
    try:
        yield m, port
    finally:
        assert m.stop() == 0
        m.check_log()
