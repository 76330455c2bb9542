"""Unmount with data that cannot be committed (issue 14, item 12).

The mount's block uploads stop answering (``--stall-uploads-after 0``: no
deadline saves them), one file is dirty and still open, and the process that
wrote a second one was killed mid-write (its close waits on the commit). The
unmount must still end within its ``--unmount-timeout``, with every
uncommitted byte in a spill file that the log names, and release the killed
writer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import LocalMount, mounted

pytestmark = pytest.mark.needs_fuse

KILLED_WRITER = """
import os, signal, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o644)
os.write(fd, b"k" * 20_000)
print(os.fstat(fd).st_ino, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the kernel's close of fd flushes, and waits
"""


def spilled(log: str) -> dict[int, tuple[bytes, dict]]:
    """ino -> (spill data, spill description), from the paths the log names."""
    out = {}
    for m in re.finditer(r"inode (\d+): \d+ uncommitted bytes \(.*?\) are kept in (\S+);", log):
        data = Path(m.group(2))
        out[int(m.group(1))] = (data.read_bytes(), json.loads(data.with_suffix(".json").read_text()))
    return out


def test_unmount_spills_what_cannot_be_committed_and_ends(needs_fuse, tmp_path: Path) -> None:
    spill_dir = tmp_path / "spill"
    m = LocalMount(tmp_path, "--stall-uploads-after", "0", "--unmount-timeout", "2",
                   "--spill-dir", str(spill_dir))  # fmt: skip
    # The writer first: a child forked while this process holds a file of
    # the mount open closes it at exec, and that close (a FUSE flush) would
    # wait on the stalled uploads too.
    killed = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(m.path / "killed")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert killed.stdout is not None
    killed_ino = int(killed.stdout.readline())
    a, b, c = os.urandom(100_000), os.urandom(5000), os.urandom(3000)
    fd = os.open(m.path / "open", os.O_CREAT | os.O_WRONLY, 0o644)
    os.pwrite(fd, a, 0)
    os.pwrite(fd, b, 1 << 20)
    os.pwrite(fd, c, 50_000)  # over part of a: the newest bytes must win in the spill
    open_ino = os.fstat(fd).st_ino
    time.sleep(0.5)  # the writer's close is now waiting in the mount
    assert killed.poll() is None

    started = time.monotonic()
    m.proc.send_signal(signal.SIGTERM)
    try:
        status = m.proc.wait(timeout=30)
    finally:
        elapsed = time.monotonic() - started
        status = m.stop()
        killed.wait(timeout=10)  # released by the unmount
        killed.stdout.close()
        try:
            os.close(fd)
        except OSError:
            pass  # the mount is gone
    log = m.log()
    assert status == 1, log  # data did not reach the cluster: not a clean exit
    assert elapsed < 15, f"unmount took {elapsed:.1f}s\n{log}"
    assert not mounted(m.path)

    spills = spilled(log)
    assert set(spills) == {open_ino, killed_ino}, log
    data, desc = spills[open_ino]
    assert desc["ino"] == open_ino and desc["volume"] == "vol" and "deadline" in desc["reason"]
    expect = bytearray(a)
    expect[50_000:53_000] = c
    assert data[:100_000] == expect
    assert data[1 << 20 : (1 << 20) + 5000] == b
    assert sorted(tuple(e) for e in desc["extents"]) == [(0, 100_000), (1 << 20, 5000)]
    data, desc = spills[killed_ino]
    assert data == b"k" * 20_000 and desc["extents"] == [[0, 20_000]]
