"""fio with crc32c verification and a read-only mount, through localfs."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import LocalMount

FIO_DIR = Path(__file__).resolve().parents[2] / "bench" / "fio"


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_mixed_writes_verify_crc32c(mnt: Path, tmp_path: Path) -> None:
    env = {**os.environ, "DIR": str(mnt), "SIZE": str(24 << 20)}
    proc = subprocess.run(
        ["fio", str(FIO_DIR / "verify-mixed.fio")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert proc.stdout.count("err= 0") == 2, proc.stdout


@pytest.mark.needs_fuse
def test_read_only_mount(tmp_path: Path) -> None:
    m = LocalMount(tmp_path, "--read-only")
    try:
        assert os.listdir(m.path) == []
        for op in (
            lambda: os.mkdir(m.path / "d"),
            lambda: os.open(m.path / "f", os.O_CREAT | os.O_WRONLY, 0o644),
            lambda: os.setxattr(m.path, "user.x", b"1"),
        ):
            with pytest.raises(OSError) as e:
                op()
            assert e.value.errno == errno.EROFS
    finally:
        assert m.stop() == 0
    m.check_log()
