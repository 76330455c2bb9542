"""fsspec transactions and ``touch(truncate=False)`` on cachefs://, by fsspec's conventions.

Inside ``with fs.transaction:`` written files stay invisible under their
names (the old bytes, or nothing, remain) until the block ends without an
exception; then each is renamed into place. An exception discards them.
Files opened with ``autocommit=False`` outside a transaction are committed or
discarded by hand, as with any fsspec ``AbstractBufferedFile``.
"""

from __future__ import annotations

import time
from pathlib import Path

import fsspec
import pytest

from cachefs.client.adapters.fsspec import TXN_MARK, CacheFSFileSystem, TransactionFile
from cachefs.client.api import connect

ROOT = Path(__file__).resolve().parents[2]
TOP = "lab/fsspec-txn"


@pytest.fixture(scope="module")
def cfs(lab) -> CacheFSFileSystem:
    fs = fsspec.filesystem(
        "cachefs", meta=",".join(lab.meta_addrs), secret_file=str(lab.credential_file("client")), zone="z1",
        skip_instance_cache=True,
    )  # fmt: skip
    yield fs
    fs.close()


def _temps(cfs: CacheFSFileSystem, where: str) -> list[str]:
    return [n for n in cfs.ls(where, detail=False) if TXN_MARK in n]


class Boom(Exception):
    pass


def test_transaction_commits_every_file_at_the_end(cfs: CacheFSFileSystem) -> None:
    d = f"{TOP}/commit"
    cfs.pipe_file(f"{d}/old.bin", b"old bytes")
    with cfs.transaction:
        with cfs.open(f"{d}/new.bin", "wb") as f:
            assert isinstance(f, TransactionFile)
            f.write(b"n" * 3_000_000)
        with cfs.open(f"{d}/old.bin", "wb") as f:
            f.write(b"replacement")
        cfs.pipe_file(f"{d}/piped.bin", b"piped")  # deferred like open()
        with cfs.open(f"{d}/text.txt", "w") as t:  # text goes through the same file
            t.write("héllo\n")
        # Closed but not committed: the names show nothing new yet.
        assert not cfs.exists(f"{d}/new.bin")
        assert not cfs.exists(f"{d}/piped.bin")
        assert cfs.cat_file(f"{d}/old.bin") == b"old bytes"
        assert len(_temps(cfs, d)) == 4
    assert cfs.cat_file(f"{d}/new.bin") == b"n" * 3_000_000
    assert cfs.cat_file(f"{d}/old.bin") == b"replacement"
    assert cfs.cat_file(f"{d}/piped.bin") == b"piped"
    assert cfs.cat_file(f"{d}/text.txt").decode() == "héllo\n"
    assert _temps(cfs, d) == []
    assert not cfs._intrans


def test_copies_in_a_transaction_are_deferred(cfs: CacheFSFileSystem) -> None:
    d = f"{TOP}/copy"
    cfs.pipe_file(f"{d}/src.bin", b"source" * 1000)
    with cfs.transaction:
        cfs.cp_file(f"{d}/src.bin", f"{d}/dst.bin")
        assert not cfs.exists(f"{d}/dst.bin")
    assert cfs.cat_file(f"{d}/dst.bin") == b"source" * 1000
    assert _temps(cfs, d) == []


def test_files_left_open_are_committed_too(cfs: CacheFSFileSystem) -> None:
    d = f"{TOP}/open"
    with cfs.transaction:
        f = cfs.open(f"{d}/a.bin", "wb")
        f.write(b"still open at commit")
    assert f.closed
    assert cfs.cat_file(f"{d}/a.bin") == b"still open at commit"
    assert _temps(cfs, d) == []


def test_an_exception_discards_the_transaction(cfs: CacheFSFileSystem) -> None:
    d = f"{TOP}/discard"
    cfs.pipe_file(f"{d}/keep.bin", b"original")
    with pytest.raises(Boom), cfs.transaction:
        with cfs.open(f"{d}/keep.bin", "wb") as f:
            f.write(b"never seen")
        unclosed = cfs.open(f"{d}/fresh.bin", "wb")
        unclosed.write(b"x" * 100)
        raise Boom
    assert cfs.cat_file(f"{d}/keep.bin") == b"original"
    assert not cfs.exists(f"{d}/fresh.bin")
    assert _temps(cfs, d) == []
    assert not cfs._intrans
    # The filesystem writes directly again afterwards.
    with cfs.open(f"{d}/after.bin", "wb") as f:
        assert not isinstance(f, TransactionFile)
        f.write(b"direct")
    assert cfs.cat_file(f"{d}/after.bin") == b"direct"


def test_append_and_exclusive_modes_in_a_transaction(cfs: CacheFSFileSystem) -> None:
    d = f"{TOP}/modes"
    cfs.pipe_file(f"{d}/log.txt", b"line 1\n")
    with cfs.transaction:
        with cfs.open(f"{d}/log.txt", "ab") as f:
            f.write(b"line 2\n")
        with cfs.open(f"{d}/none-yet.txt", "ab") as f:
            f.write(b"first\n")
        assert cfs.cat_file(f"{d}/log.txt") == b"line 1\n"
        with pytest.raises(FileExistsError):
            cfs.open(f"{d}/log.txt", "xb")
        with cfs.open(f"{d}/exclusive.bin", "xb") as f:
            f.write(b"x")
    assert cfs.cat_file(f"{d}/log.txt") == b"line 1\nline 2\n"
    assert cfs.cat_file(f"{d}/none-yet.txt") == b"first\n"
    assert cfs.cat_file(f"{d}/exclusive.bin") == b"x"
    assert _temps(cfs, d) == []


def test_autocommit_false_files_commit_and_discard_by_hand(cfs: CacheFSFileSystem) -> None:
    d = f"{TOP}/manual"
    f = cfs.open(f"{d}/kept.bin", "wb", autocommit=False)
    f.write(b"kept")
    f.close()
    assert not cfs.exists(f"{d}/kept.bin")
    f.commit()
    assert cfs.cat_file(f"{d}/kept.bin") == b"kept"
    g = cfs.open(f"{d}/dropped.bin", "wb", autocommit=False)
    g.write(b"dropped")
    g.discard()
    assert g.closed and not cfs.exists(f"{d}/dropped.bin")
    assert _temps(cfs, d) == []
    # Reads in a transaction are plain reads.
    with cfs.transaction, cfs.open(f"{d}/kept.bin", "rb") as r:
        assert r.read() == b"kept"


def test_a_transaction_is_seen_whole_by_another_client(cfs: CacheFSFileSystem, lab) -> None:
    """Another process's client sees the old file until the commit, then the new one."""
    d = f"{TOP}/other"
    cfs.pipe_file(f"{d}/model.bin", b"v1")
    with connect(lab.meta_addrs, "lab", secret=lab.credential("client")) as other:
        with cfs.transaction:
            with cfs.open(f"{d}/model.bin", "wb") as f:
                f.write(b"v2" * 1000)
            assert other.read_bytes("/fsspec-txn/other/model.bin") == b"v1"
        assert other.read_bytes("/fsspec-txn/other/model.bin") == b"v2" * 1000


def test_touch_without_truncate_updates_the_time_only(cfs: CacheFSFileSystem) -> None:
    d = f"{TOP}/touch"
    cfs.pipe_file(f"{d}/data.bin", b"payload")
    client = cfs.client("lab")
    client.utime("/fsspec-txn/touch/data.bin", ns=(10**18, 10**18))  # 2001-09-09
    assert client.stat("/fsspec-txn/touch/data.bin").st_mtime_ns == 10**18
    before = time.time_ns()
    cfs.touch(f"{d}/data.bin", truncate=False)
    st = client.stat("/fsspec-txn/touch/data.bin")
    assert st.st_mtime_ns >= before and st.st_atime_ns >= before
    assert cfs.cat_file(f"{d}/data.bin") == b"payload"
    assert cfs.modified(f"{d}/data.bin").timestamp() * 1e9 >= before - 10**9
    # Missing: created empty (parents too); truncate=True empties.
    cfs.touch(f"{d}/deep/new.bin", truncate=False)
    assert cfs.info(f"{d}/deep/new.bin")["size"] == 0
    cfs.touch(f"{d}/data.bin")
    assert cfs.cat_file(f"{d}/data.bin") == b""


def test_utime_follows_os_utime(cfs: CacheFSFileSystem) -> None:
    client = cfs.client("lab")
    client.makedirs("/fsspec-txn/utime", exist_ok=True)
    client.write_bytes("/fsspec-txn/utime/f", b"1")
    client.utime("/fsspec-txn/utime/f", (1_000_000.5, 2_000_000.25))
    st = client.stat("/fsspec-txn/utime/f")
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_500_000_000, 2_000_000_250_000_000)
    with pytest.raises(ValueError):
        client.utime("/fsspec-txn/utime/f", (1, 2), ns=(1, 2))
    with pytest.raises(FileNotFoundError):
        client.utime("/fsspec-txn/utime/missing")


def test_no_not_implemented_left_in_the_package() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("cachefs", "client", "metanode", "cachenode")
        for path in sorted((ROOT / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "raise NotImplementedError" in line
    ]
    assert not found, found
