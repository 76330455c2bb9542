"""A lab mount's control files: ``cachefs stats`` reads MOUNTPOINT/.cachefs/stats
while a workload runs, and MOUNTPOINT/.cachefs/accesslog streams one line per
FUSE op to whoever reads it; neither is listed by readdir nor writable."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cachefs.testing.labs import running_lab

pytestmark = pytest.mark.needs_fuse


@pytest.fixture(scope="module")
def lab_mount(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("ctl")
    with running_lab(root / "lab", metrics=True, cache_memory="16M", mount_cache="64M") as lab:
        mnt = root / "mnt"
        lab.mount(str(mnt), l2=False)
        yield mnt


def _cachefs(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cachefs.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_stats_shows_the_workload_per_second(needs_fuse, lab_mount: Path) -> None:
    data = os.urandom(6 << 20)
    (lab_mount / "seed").write_bytes(data)
    stop = threading.Event()

    def workload() -> None:
        i = 0
        while not stop.is_set():
            (lab_mount / f"w{i % 4}").write_bytes(data[: 1 << 20])
            with open(lab_mount / "seed", "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                assert f.read() == data
            i += 1

    worker = threading.Thread(target=workload)
    worker.start()
    try:
        proc = _cachefs("stats", str(lab_mount), "--json", "--count", "3", "--interval", "0.5")
    finally:
        stop.set()
        worker.join()
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(samples) == 3
    for s in samples:
        assert 0.4 < s["interval"] < 5
        assert s["ops_per_s"] > 0 and s["ops"]
        for ratio in ("l1_hit_ratio", "cache_hit_ratio", "backing_ratio"):
            assert s[ratio] is None or 0 <= s[ratio] <= 1
    assert any(s["read_bytes_per_s"] > 0 for s in samples)
    assert any(s["write_bytes_per_s"] > 0 for s in samples)
    assert any(s["rpc_per_s"] > 0 and s["rpc_latency_ms"] > 0 for s in samples)
    assert {"read", "write"} <= {op for s in samples for op in s["ops"]}
    # The table form: a header, then one line per sample.
    table = _cachefs("stats", str(lab_mount), "--count", "1", "--interval", "0.2")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split()[:3] == ["ops/s", "lat", "ms"] and len(row.split()) >= 10


def test_stats_refuses_what_is_not_a_cachefs_mount(tmp_path: Path) -> None:
    proc = _cachefs("stats", str(tmp_path), "--count", "1")
    assert proc.returncode != 0 and "is not a mount point" in proc.stderr
    proc = _cachefs("stats", "/proc", "--count", "1")
    assert proc.returncode != 0 and "is not a cachefs mount" in proc.stderr


def test_the_control_directory_is_hidden_and_read_only(needs_fuse, lab_mount: Path) -> None:
    control = lab_mount / ".cachefs"
    assert ".cachefs" not in os.listdir(lab_mount)
    assert sorted(os.listdir(control)) == ["accesslog", "stats"]
    assert control.is_dir() and (control / "stats").is_file()
    assert "cachefs_mount_op_latency_seconds_count" in (control / "stats").read_text()
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
        with pytest.raises(PermissionError):
            os.open(control / "stats", flags)
    with pytest.raises(OSError) as exc:
        os.chmod(control / "stats", 0o666)
    assert exc.value.errno == errno.EPERM
    with pytest.raises(FileExistsError):
        os.mkdir(control)
    with pytest.raises(FileNotFoundError):
        (control / "nothing").stat()


def test_the_access_log_streams_one_line_per_op_while_read(needs_fuse, lab_mount: Path) -> None:
    (lab_mount / "a").write_bytes(b"x" * 5000)
    fd = os.open(lab_mount / ".cachefs" / "accesslog", os.O_RDONLY)
    try:
        (lab_mount / "b").write_bytes(b"y" * 3000)
        assert (lab_mount / "a").read_bytes() == b"x" * 5000
        with pytest.raises(FileNotFoundError):
            (lab_mount / "missing").stat()
        text, deadline = "", time.monotonic() + 10
        while "missing" not in text or " read (" not in text:
            assert time.monotonic() < deadline, text
            text += os.read(fd, 65536).decode()
    finally:
        os.close(fd)
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    line = re.compile(r"^\d{4}\.\d\d\.\d\d \d\d:\d\d:\d\d\.\d{6} (\[uid:\d+,gid:\d+,pid:\d+\] )?"
                      r"(\w+) \((.*)\): (OK|E[A-Z]+) <(\d+\.\d{6})>$")
    parsed = [line.match(ln) for ln in lines]
    assert all(parsed), [ln for ln, m in zip(lines, parsed, strict=True) if not m]
    ops = {m.group(2) for m in parsed if m}
    assert {"create", "write", "flush", "release", "open", "read", "lookup"} <= ops, ops
    assert any(m.group(2) == "lookup" and "missing" in m.group(3) and m.group(4) == "ENOENT"
               for m in parsed if m)
    assert any(m.group(2) == "write" and "<3000 bytes>" in m.group(3) for m in parsed if m)
    # The log's own reads are not in it, and with nobody reading it nothing is kept.
    assert not any(m.group(2) == "read" and int(m.group(3).split(",")[0]) >= 1 << 62 for m in parsed if m)
    fd = os.open(lab_mount / ".cachefs" / "accesslog", os.O_RDONLY)
    try:
        started, later = time.monotonic(), ""
        while not later.endswith("#\n"):  # a keep-alive after a second
            later += os.read(fd, 65536).decode()
            assert time.monotonic() - started < 5, later
        assert time.monotonic() - started > 0.5
    finally:
        os.close(fd)
    # Nothing from before this open; the kernel may send an op of its own meanwhile
    # (a forget after someone dropped the caches), which is logged as it happens.
    assert not any(word in later for word in ("missing", "create", "<3000 bytes>", "write")), later


def test_sighup_reopens_the_mount_log_that_logrotate_moved(needs_fuse, lab_mount: Path) -> None:
    """The mount keeps serving (SIGHUP no longer unmounts) and logs to a new file at the old path."""
    from cachefs.client.mount import pid_file

    pid = int(pid_file(str(lab_mount)).read_text().split()[0])
    log = lab_mount.parent / "lab" / "logs" / "mount.log"
    rotated = log.with_name("mount.log.1")
    log.rename(rotated)
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + 20
    while not (log.exists() and "SIGHUP: log level INFO" in log.read_text()):
        assert time.monotonic() < deadline, rotated.read_text()[-2000:]
        time.sleep(0.1)
    (lab_mount / "after-hup").write_bytes(b"still here")
    assert (lab_mount / "after-hup").read_bytes() == b"still here" and os.path.ismount(lab_mount)
    assert "SIGHUP" not in rotated.read_text()
