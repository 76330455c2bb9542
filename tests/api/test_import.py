"""``cachefs import`` against a real lab: through its FUSE mount and through the native client.

The source trees have what real datasets and home directories have: nested
and empty directories, symbolic links (relative, absolute, dangling, to a
directory), names with spaces, newlines, non-UTF-8 bytes and 255 bytes,
odd modes and old modification times, and files from empty to several
chunks of the copy loop. A copy is compared with its source entry by entry
(type, mode, size, mtime to the nanosecond, bytes, link target).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefs.lab.cluster import VOLUME

REPO = Path(__file__).resolve().parents[2]
OLD = 1_500_000_000_123_456_789  # 2017, with nanoseconds


def cachefs_import(*args: str, timeout: float = 300) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "cachefs.cli", "import", *args, "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    summary = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, summary, proc.stderr


def odd_tree(root: Path) -> None:
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "empty" / "nested-empty").mkdir(parents=True)
    (root / "a" / "zero").write_bytes(b"")
    (root / "a" / "one").write_bytes(b"1")
    (root / "a" / "b" / "small.jpg").write_bytes(os.urandom(110 << 10))
    (root / "a" / "b" / "c" / "big.bin").write_bytes(os.urandom((9 << 20) + 3))  # three copy chunks
    (root / "with space and\nnewline").write_bytes(b"odd name")
    (root / "ünïcødé-名前").write_bytes(b"unicode")
    os.close(os.open(os.path.join(os.fsencode(root), b"not-utf8-\xff\xfe"), os.O_CREAT | os.O_WRONLY, 0o644))
    (root / ("n" * 255)).write_bytes(b"longest name")
    (root / "-starts-with-dash").write_bytes(b"dash")
    os.symlink("b/small.jpg", root / "a" / "rel-link")
    os.symlink("/nonexistent/target", root / "dangling")
    os.symlink("a/b", root / "dir-link")
    (root / "a" / "script.sh").write_bytes(b"#!/bin/sh\n")
    os.chmod(root / "a" / "script.sh", 0o751)
    os.chmod(root / "a" / "one", 0o600)
    os.chmod(root / "a" / "zero", 0o4755)  # setuid and setgid survive, on empty and written files
    os.chmod(root / "a" / "b" / "small.jpg", 0o2644)
    for i, path in enumerate(sorted(root.rglob("*"), key=lambda p: -len(p.parts))):
        os.utime(path, ns=(OLD + i, OLD + 1000 * i), follow_symlinks=False)
    os.chmod(root / "a" / "b" / "c", 0o555)  # read-only directory: filled before it gets its mode
    os.utime(root / "a" / "b" / "c", ns=(OLD, OLD + 7))


def entries(root: Path) -> dict[bytes, tuple]:
    """Everything under ``root`` as comparable tuples, by path relative to it (bytes: names need not be UTF-8)."""
    out = {}
    base = os.fsencode(root)
    for top, dirs, files in os.walk(base):
        for name in dirs + files:
            path = os.path.join(top, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, base)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path), st.st_mtime_ns)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            else:
                with open(path, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, f.read())
    return out


def assert_same_tree(src: Path, dst: Path) -> None:
    want, got = entries(src), entries(dst)
    assert sorted(got) == sorted(want)
    for rel, entry in want.items():
        if entry[0] == "link":  # a link's own time is kept where the kernel lets utimensat set it
            assert got[rel][:2] == entry[:2], rel
        else:
            assert got[rel] == entry, rel


def test_a_tree_with_links_empty_dirs_and_odd_names_arrives_whole_and_a_rerun_copies_nothing(
        small_mnt: Path, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", small_mnt / f"import-odd-{os.getpid()}"
    src.mkdir()
    dst.mkdir()
    odd_tree(src)
    rc, summary, err = cachefs_import(str(src), str(dst), "--jobs", "4")
    assert rc == 0, err
    files = sum(1 for v in entries(src).values() if v[0] == "file")
    assert summary["copied"] == files and summary["skipped"] == 0 and summary["errors"] == []
    assert summary["symlinks"] == 3 and summary["dirs"] == 5 and summary["interrupted"] is False
    assert_same_tree(src, dst)
    rc, again, err = cachefs_import(str(src), str(dst))
    assert rc == 0, err
    assert again["copied"] == 0 and again["skipped"] == files and again["bytes_copied"] == 0
    assert_same_tree(src, dst)


def many_files(root: Path, n: int, size: int) -> None:
    for d in range(10):
        (root / f"class{d}").mkdir(parents=True)
    for i in range(n):
        path = root / f"class{i % 10}" / f"img{i:05d}.jpg"
        path.write_bytes(os.urandom(size))
        os.utime(path, ns=(OLD, OLD + i))


def _interrupt(src: Path, dst: Path, sig: int) -> subprocess.Popen:
    """Start an import and send ``sig`` once some files have arrived and many have not."""
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "import", str(src), str(dst), "--jobs", "2",
                             "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while sum(1 for _ in dst.rglob("*.jpg")) < 20:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the import made no progress"
        time.sleep(0.05)
    proc.send_signal(sig)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_an_import_interrupted_by_a_signal_resumes_where_it_stopped(small_mnt: Path, tmp_path: Path,
                                                                    sig: int) -> None:
    n = 600
    src, dst = tmp_path / "src", small_mnt / f"import-resume-{sig}-{os.getpid()}"
    many_files(src, n, 20 << 10)
    dst.mkdir()
    proc = _interrupt(src, dst, sig)
    out, err = proc.communicate(timeout=120)
    arrived = sum(1 for _ in dst.rglob("*.jpg"))
    assert 20 <= arrived < n, "the signal came too late to interrupt anything"
    if sig == signal.SIGINT:  # the files in flight finish, then the summary
        assert proc.returncode == 130, err
        first = json.loads(out)
        assert first["interrupted"] is True and 0 < first["copied"] < n and first["errors"] == []
    else:
        assert proc.returncode == -signal.SIGKILL
    rc, second, err = cachefs_import(str(src), str(dst))
    assert rc == 0, err
    assert second["copied"] + second["skipped"] == n
    # at most the files that were in flight (and, after SIGKILL, not yet given their time) are copied again
    assert second["skipped"] >= arrived - 4 and second["copied"] <= n - arrived + 4
    if sig == signal.SIGINT:
        assert second["skipped"] == first["copied"]
    assert_same_tree(src, dst)


def test_a_file_whose_size_or_time_changed_is_copied_again(small_mnt: Path, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", small_mnt / f"import-changed-{os.getpid()}"
    many_files(src, 20, 4096)
    dst.mkdir()
    assert cachefs_import(str(src), str(dst))[0] == 0
    grown, touched = src / "class3" / "img00003.jpg", src / "class4" / "img00004.jpg"
    before = grown.stat().st_mtime_ns
    grown.write_bytes(os.urandom(9000))
    os.utime(grown, ns=(OLD, before))  # same time, new size
    touched.write_bytes(os.urandom(4096))
    os.utime(touched, ns=(OLD, OLD + 10**9))  # same size, new time
    rc, summary, err = cachefs_import(str(src), str(dst))
    assert rc == 0, err
    assert summary["copied"] == 2 and summary["skipped"] == 18
    assert_same_tree(src, dst)


def test_what_cannot_be_copied_is_an_error_naming_its_path_and_the_rest_arrives(small_mnt: Path,
                                                                                 tmp_path: Path) -> None:
    src, dst = tmp_path / "src", small_mnt / f"import-errors-{os.getpid()}"
    many_files(src, 10, 1000)
    os.mkfifo(src / "class1" / "a-fifo")
    dst.mkdir()
    (dst / "class2").write_bytes(b"a file where the source has a directory")
    rc, summary, err = cachefs_import(str(src), str(dst))
    assert rc == 1
    assert [e for e in summary["errors"] if "a-fifo" in e and "not a regular file" in e], summary["errors"]
    assert summary["copied"] == 10  # the file in the way was replaced by the directory
    assert (dst / "class2").is_dir()
    rc, _, err = cachefs_import(str(src), str(dst / "missing"))
    assert rc == 2 and "missing" in err and "not a directory" in err


def test_the_native_client_imports_without_a_mount(small_lab, small_mnt: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    odd_tree(src)
    name = f"import-native-{os.getpid()}"
    (small_mnt / name).mkdir()
    args = ["--volume", VOLUME, "--meta", ",".join(small_lab.meta_addrs), "--zone", "z1",
            "--secret-file", str(small_lab.credential_file("client"))]
    rc, summary, err = cachefs_import(str(src), f"/{name}", *args)
    assert rc == 0, err
    assert summary["errors"] == [] and summary["copied"] > 0
    assert_same_tree(src, small_mnt / name)  # seen through the mount
    rc, again, err = cachefs_import(str(src), f"/{name}", *args)
    assert rc == 0, err
    assert again["copied"] == 0 and again["skipped"] == summary["copied"]


def test_on_a_terminal_a_progress_bar_counts_files_bytes_rate_and_eta(tmp_path: Path) -> None:
    """The bar is drawn only on a terminal (here a pseudo-terminal); the destination is any directory."""
    import pty

    src, dst = tmp_path / "src", tmp_path / "dst"
    many_files(src, 120, 1000)
    dst.mkdir()
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdout and stderr are the terminal
        os.chdir(REPO)
        os.environ["COLUMNS"] = "160"
        os.execv(sys.executable, [sys.executable, "-m", "cachefs.cli", "import", str(src), str(dst)])
    screen = bytearray()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        screen.extend(chunk)
    _, status = os.waitpid(pid, 0)
    text = screen.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "120/120 files" in text and "120.0/120.0 kB" in text and "files/s" in text and "ETA" in text, text
    assert "import done: 120 files copied" in text, text
