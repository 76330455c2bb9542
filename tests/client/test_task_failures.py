"""A bug in one background task of a mount must not unmount it (issue 14, item 11).

Each case starts ``tests.client.localfs`` with ``--fail-once NAME``: the first
call of the method behind that task raises ``RuntimeError``, as a bug would.
The mount must log it (with its traceback), count it in
``cachefs_mount_task_failures_total``, keep serving, and unmount cleanly; an
upload that died fails its file's ``close`` with EIO rather than losing the
data silently.
"""

from __future__ import annotations

import errno
import os
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from cachefs.testing.ports import free_port

from .conftest import LocalMount

pytestmark = pytest.mark.needs_fuse

DEADLINE = 20.0


def failures(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^cachefs_mount_task_failures_total\{task="([^"]+)"\} (\S+)$', text, re.M)
    }


def wait_for_failure(port: int, task: str, poke: Callable[[], None] = lambda: None) -> None:
    deadline = time.monotonic() + DEADLINE
    while failures(port).get(task) != 1.0:
        assert time.monotonic() < deadline, f"no failure of {task} counted: {failures(port)}"
        poke()
        time.sleep(0.1)


def upload(mnt: Path) -> None:
    fd = os.open(mnt / "lost", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"x" * 5000)
    with pytest.raises(OSError) as exc:
        os.close(fd)
    assert exc.value.errno == errno.EIO


def compaction(mnt: Path) -> None:
    with open(mnt / "many", "wb") as f:
        for i in range(20):  # 20 slices > --compact-after 16
            f.seek(i * 10_000)
            f.write(b"s" * 100)
            f.flush()
            os.fsync(f.fileno())


def idle_seal(mnt: Path) -> None:
    f = open(mnt / "idle", "wb")  # noqa: SIM115 - kept open while the idle sealer runs
    f.write(b"i" * 1000)
    f.flush()  # into the mount's buffer, not committed
    idle_seal.file = f  # type: ignore[attr-defined]


def readahead(mnt: Path) -> None:
    (mnt / "seq").write_bytes(os.urandom(2 << 20))
    with open(mnt / "seq", "rb", buffering=0) as f:
        while f.read(128 << 10):
            pass


def early_read(mnt: Path) -> None:
    (mnt / "early").write_bytes(b"e" * 70_000)
    # An open starts an early read only when L1 (4 MiB in localfs) lacks the
    # file's start: another file read through it makes L1 let it go.
    (mnt / "filler").write_bytes(b"f" * (6 << 20))
    for name in ("filler", "early"):
        with open(mnt / name, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            while name == "filler" and f.read(1 << 20):
                pass
    with open(mnt / "early", "rb") as f:
        assert f.read() == b"e" * 70_000


# --fail-once NAME: (the task it fails, what makes that task run, whether the
# mount restarts the task: the loops it cannot do without)
CASES = {
    "upload": ("FileWriter._upload", upload, False),
    "compaction": ("Compactor._later", compaction, False),
    "upkeep": ("Session.run", lambda mnt: None, True),
    "idle-seal": ("Volume._seal_idle_writes", idle_seal, True),
    "readahead": ("Reader._readahead", readahead, False),
    "early-read": ("Volume.read_early", early_read, False),
}


@pytest.mark.parametrize("inject", sorted(CASES))
def test_a_failing_background_task_does_not_unmount(needs_fuse, tmp_path: Path, inject: str) -> None:
    task, trigger, restarted = CASES[inject]
    port = free_port()
    m = LocalMount(tmp_path, "--fail-once", inject, "--metrics-port", str(port))
    try:
        trigger(m.path)
        wait_for_failure(port, task)
        # Still serving, and correctly: new data round-trips.
        data = os.urandom(300_000)
        (m.path / "after").write_bytes(data)
        assert (m.path / "after").read_bytes() == data
        if inject == "idle-seal":
            f = idle_seal.file  # type: ignore[attr-defined]
            f.close()  # the restarted sealer or the close commits it
            assert (m.path / "idle").read_bytes() == b"i" * 1000
        assert sum(failures(port).values()) == 1.0
    finally:
        status = m.stop()
    log = m.log()
    assert status == 0, log
    reports = [line for line in log.splitlines() if "failed unexpectedly" in line]
    again = "; restarting it" if restarted else ""
    assert reports == [f"ERROR cachefs.tasks: background task {task} failed unexpectedly{again}; "
                       "everything else keeps running"], log
    assert "Traceback" in log and "RuntimeError: injected failure in" in log, log
    others = [line for line in log.splitlines() if line.startswith("ERROR") and line not in reports]
    if inject == "upload":  # the lost data is reported where the application learns of it
        assert others and all("flush failed" in line or "release failed" in line for line in others), log
    else:
        assert not others, log
