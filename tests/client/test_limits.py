"""RLIMIT_FSIZE on a mount behaves as on ext4 (issue 16, item 4).

The same program runs against the mount and against a directory on local
ext4: writes and truncates past the caller's file-size limit fail with EFBIG
(SIGXFSZ ignored) or kill the caller with SIGXFSZ (default action), a write
across the limit is short, and truncating such a file back to zero works.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_fuse

PROGRAM = """
import errno, json, os, resource, signal, sys
path, ignore = sys.argv[1], sys.argv[2] == "ignore"
signal.signal(signal.SIGXFSZ, signal.SIG_IGN if ignore else signal.SIG_DFL)  # Python ignores it
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
out = []
def step(name, fn):
    try:
        out.append([name, "ok", fn()])
    except OSError as e:
        out.append([name, errno.errorcode[e.errno]])
    print(json.dumps(out[-1]), flush=True)
step("write under the limit", lambda: os.pwrite(fd, b"a" * 1000, 0))
step("write across it", lambda: os.pwrite(fd, b"b" * 1000, 99_500))
step("write past it", lambda: os.pwrite(fd, b"c", 100_000))
step("ftruncate past it", lambda: os.ftruncate(fd, 200_000))
step("truncate past it", lambda: os.truncate(path, 200_000))
step("ftruncate to it", lambda: os.ftruncate(fd, 100_000))
step("size", lambda: os.fstat(fd).st_size)
step("ftruncate to 0", lambda: os.ftruncate(fd, 0))
step("fsync", lambda: os.fsync(fd))
os.close(fd)
step("size after close", lambda: os.stat(path).st_size)
"""


def run(path: Path, mode: str) -> tuple[int, list[list[object]]]:
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(path), mode], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()]


def is_ext4(path: Path) -> bool:
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return kind.stdout.strip() == "ext2/ext3"


@pytest.mark.parametrize("mode", ["ignore", "default"])
def test_rlimit_fsize_as_on_ext4(mnt: Path, tmp_path: Path, mode: str) -> None:
    if not is_ext4(tmp_path):
        pytest.skip(f"{tmp_path} is not on ext4, the reference")
    reference = run(tmp_path / "f", mode)
    assert run(mnt / "f", mode) == reference
    if mode == "ignore":
        assert reference[0] == 0 and reference[1][2] == ["write past it", "EFBIG"]
        assert reference[1][-1] == ["size after close", "ok", 0]
    else:
        assert reference[0] == -signal.SIGXFSZ and len(reference[1]) == 2
