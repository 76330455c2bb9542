"""cachefs://VOLUME/PATH through fsspec, checked against fsspec's own conventions."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import fsspec
import pytest

from cachefs.client.adapters.fsspec import CacheFSFileSystem
from cachefs.client.api import FileSystem


@pytest.fixture(scope="module")
def cfs(lab) -> CacheFSFileSystem:
    fs = fsspec.filesystem(
        "cachefs", meta=",".join(lab.meta_addrs), secret_file=str(lab.credential_file("client")), zone="z1"
    )
    yield fs
    fs.close()


def test_registered_through_the_entry_point() -> None:
    assert fsspec.get_filesystem_class("cachefs") is CacheFSFileSystem
    assert "cachefs" in fsspec.available_protocols()


def test_options_come_from_the_environment(lab, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEFS_META", ",".join(lab.meta_addrs))
    monkeypatch.setenv("CACHEFS_SECRET_FILE", str(lab.credential_file("client")))
    with fsspec.open("cachefs://lab/fsspec/env.txt", "wb") as f:
        f.write(b"via env")
    of = fsspec.open("cachefs://lab/fsspec/env.txt", "rb")
    with of as f:
        assert f.read() == b"via env"
    of.fs.close()
    monkeypatch.delenv("CACHEFS_META")
    with pytest.raises(ValueError, match="metanode"):
        CacheFSFileSystem(skip_instance_cache=True)
    monkeypatch.setenv("CACHEFS_META", "127.0.0.1:1")
    monkeypatch.delenv("CACHEFS_SECRET_FILE")
    monkeypatch.delenv("CACHEFS_SECRET", raising=False)
    with pytest.raises(ValueError, match="secret"):
        CacheFSFileSystem(skip_instance_cache=True)


def test_ls_info_and_names(cfs: CacheFSFileSystem) -> None:
    cfs.pipe("cachefs://lab/fsspec/ls/a.bin", b"a" * 10)  # parents made on write
    cfs.pipe_file("lab/fsspec/ls/sub/b.bin", b"b" * 20)
    listing = cfs.ls("cachefs://lab/fsspec/ls")
    assert [e["name"] for e in listing] == ["lab/fsspec/ls/a.bin", "lab/fsspec/ls/sub"]
    a, sub = listing
    assert (a["type"], a["size"]) == ("file", 10)
    assert (sub["type"], sub["size"]) == ("directory", 0)
    assert {"name", "size", "type", "mtime"} <= set(a)
    assert cfs.ls("lab/fsspec/ls/", detail=False) == ["lab/fsspec/ls/a.bin", "lab/fsspec/ls/sub"]
    assert cfs.ls("lab/fsspec/ls/a.bin", detail=False) == [
        "lab/fsspec/ls/a.bin"
    ]  # a file lists itself
    assert cfs.info("lab/fsspec/ls/sub/b.bin")["size"] == 20
    assert cfs.info("lab")["type"] == "directory"
    assert cfs.ls("cachefs://", detail=False) == ["lab"]
    assert cfs.ls("")[0] == {"name": "lab", "size": 0, "type": "directory"}
    assert cfs.isdir("lab/fsspec/ls/sub") and cfs.isfile("lab/fsspec/ls/a.bin")
    assert cfs.size("lab/fsspec/ls/sub/b.bin") == 20
    assert cfs.find("lab/fsspec/ls") == ["lab/fsspec/ls/a.bin", "lab/fsspec/ls/sub/b.bin"]
    assert cfs.glob("lab/fsspec/ls/**/*.bin") == ["lab/fsspec/ls/a.bin", "lab/fsspec/ls/sub/b.bin"]
    assert cfs.du("lab/fsspec/ls") == 30
    assert cfs.modified("lab/fsspec/ls/a.bin").tzinfo is not None
    with pytest.raises(FileNotFoundError):
        cfs.info("lab/fsspec/ls/missing")
    with pytest.raises(FileNotFoundError):
        cfs.ls("lab/fsspec/ls/missing")
    assert not cfs.exists("lab/fsspec/ls/missing")


def test_cat_file_ranges(cfs: CacheFSFileSystem) -> None:
    data = os.urandom(5 << 20)
    cfs.pipe_file("lab/fsspec/cat.bin", data)
    assert cfs.cat_file("lab/fsspec/cat.bin") == data
    assert cfs.cat("cachefs://lab/fsspec/cat.bin") == data
    for start, end in [
        (0, 10),
        (100, None),
        (None, 7),
        (-50, None),
        (-50, -10),
        (4 << 20, (4 << 20) + 5),
        (10, 5),
    ]:
        assert cfs.cat_file("lab/fsspec/cat.bin", start, end) == data[start:end], (start, end)
    assert cfs.read_block("lab/fsspec/cat.bin", 1000, 2000) == data[1000:3000]
    paths = ["lab/fsspec/cat.bin"] * 4 + ["lab/fsspec/nope"]
    got = cfs.cat_ranges(paths, [0, 10, -5, 1 << 20, 0], [5, 20, None, (1 << 20) + 3, 1])
    assert got[:4] == [data[:5], data[10:20], data[-5:], data[1 << 20 : (1 << 20) + 3]]
    assert isinstance(got[4], FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        cfs.cat_ranges(paths, 0, 1, on_error="raise")
    multi = cfs.cat(["lab/fsspec/cat.bin", "lab/fsspec/env.txt"], on_error="omit")
    assert multi["lab/fsspec/cat.bin"] == data


def test_open_modes(cfs: CacheFSFileSystem) -> None:
    with cfs.open("lab/fsspec/modes/w.bin", "wb") as f:
        f.write(b"hello ")
        f.write(b"world")
    with cfs.open("lab/fsspec/modes/w.bin", "rb") as f:
        assert f.size == 11
        assert f.read(5) == b"hello"
        f.seek(-5, io.SEEK_END)
        assert f.read() == b"world"
        assert f.tell() == 11
    with cfs.open("lab/fsspec/modes/w.bin", "ab") as f:
        f.write(b"!")
    assert cfs.cat("lab/fsspec/modes/w.bin") == b"hello world!"
    with cfs.open("lab/fsspec/modes/t.txt", "w", encoding="utf-8") as f:
        f.write("zwei\nLinien ü\n")
    with cfs.open("lab/fsspec/modes/t.txt", "r", encoding="utf-8") as f:
        assert f.readlines() == ["zwei\n", "Linien ü\n"]
    with pytest.raises(FileExistsError):
        cfs.open("lab/fsspec/modes/w.bin", "xb")
    with pytest.raises(FileNotFoundError):
        cfs.open("lab/fsspec/modes/none", "rb")
    with cfs.open("lab/fsspec/modes/gz.txt.gz", "wt", compression="gzip") as f:
        f.write("compressed")
    with cfs.open("lab/fsspec/modes/gz.txt.gz", "rt", compression="infer") as f:
        assert f.read() == "compressed"
    of = fsspec.open("cachefs://lab/fsspec/modes/w.bin", "rb", **cfs.storage_options)
    with of as f:
        assert f.read() == b"hello world!"


def test_mkdir_rm_mv_cp(cfs: CacheFSFileSystem) -> None:
    cfs.mkdir("lab/fsspec/tree/x/y")
    with pytest.raises(FileExistsError):
        cfs.mkdir("lab/fsspec/tree/x/y")
    cfs.makedirs("lab/fsspec/tree/x/y", exist_ok=True)
    cfs.touch("lab/fsspec/tree/x/y/f")
    assert cfs.cat("lab/fsspec/tree/x/y/f") == b""
    cfs.pipe_file("lab/fsspec/tree/x/g", b"G")
    cfs.cp_file("lab/fsspec/tree/x/g", "lab/fsspec/tree/copy")
    assert cfs.cat("lab/fsspec/tree/copy") == b"G"
    ino = cfs.info("lab/fsspec/tree/x")["ino"]
    cfs.mv("lab/fsspec/tree/x", "lab/fsspec/tree/moved")  # a directory: one atomic rename
    assert cfs.info("lab/fsspec/tree/moved")["ino"] == ino
    assert cfs.find("lab/fsspec/tree") == [
        "lab/fsspec/tree/copy",
        "lab/fsspec/tree/moved/g",
        "lab/fsspec/tree/moved/y/f",
    ]
    cfs.rm_file("lab/fsspec/tree/copy")
    with pytest.raises(OSError):
        cfs.rmdir("lab/fsspec/tree/moved")  # not empty
    cfs.rm("lab/fsspec/tree", recursive=True)
    assert not cfs.exists("lab/fsspec/tree")
    with pytest.raises(FileExistsError):
        cfs.pipe_file("lab/fsspec/env.txt", b"x", mode="create")


def test_pickles_and_reconnects(cfs: CacheFSFileSystem) -> None:
    cfs.pipe_file("lab/fsspec/pickled", b"p")
    clone = pickle.loads(pickle.dumps(cfs))
    assert clone.cat("lab/fsspec/pickled") == b"p"


@pytest.mark.needs_fuse
def test_fsspec_and_mount_agree(cfs: CacheFSFileSystem, fs: FileSystem, mount: Path) -> None:
    data = os.urandom(3 << 20)
    (mount / "fsspec-mnt").mkdir(exist_ok=True)
    (mount / "fsspec-mnt" / "m").write_bytes(data)
    assert cfs.cat_file("lab/fsspec-mnt/m") == data
    cfs.pipe_file("lab/fsspec-mnt/f", data[::-1])
    assert (mount / "fsspec-mnt" / "f").read_bytes() == data[::-1]
    assert sorted(cfs.ls("lab/fsspec-mnt", detail=False)) == [
        f"lab/fsspec-mnt/{n}" for n in sorted(os.listdir(mount / "fsspec-mnt"))
    ]
