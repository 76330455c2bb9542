"""The native library against a real cluster, and against a FUSE mount of it.

What the library reads must be byte for byte what the mount reads, and what
either one writes (and closes) the other sees at its next open.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from pathlib import Path

import pytest
import trio

from cachefs.client.api import FileSystem, connect, open_volume

from .conftest import drop_page_cache

MiB = 1 << 20


def test_namespace_calls(fs: FileSystem) -> None:
    fs.makedirs("native/ns/a/b")
    fs.makedirs("native/ns/a/b", exist_ok=True)
    with pytest.raises(FileExistsError):
        fs.makedirs("native/ns/a/b")
    fs.write_bytes("native/ns/a/f1", b"one")
    fs.write_bytes("native/ns/a/b/f2", b"two!")
    assert sorted(fs.listdir("native/ns/a")) == ["b", "f1"]
    assert list(fs.walk("/native/ns")) == [
        ("/native/ns", ["a"], []),
        ("/native/ns/a", ["b"], ["f1"]),
        ("/native/ns/a/b", [], ["f2"]),
    ]
    st = fs.stat("native/ns/a/b/f2")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 4 and st.st_nlink == 1
    assert stat.S_ISDIR(fs.stat("native/ns/./a/../a/b").st_mode)
    entries = {e.name: e for e in fs.scandir("native/ns/a")}
    assert entries["b"].is_dir() and entries["f1"].is_file() and entries["f1"].stat.st_size == 3
    assert fs.exists("native/ns/a/f1") and fs.isfile("native/ns/a/f1") and fs.isdir("native/ns/a")
    assert not fs.exists("native/ns/nope") and not fs.exists("native/ns/a/f1/below")

    fs.rename("native/ns/a/f1", "native/ns/a/b/f1")
    assert sorted(fs.listdir("native/ns/a/b")) == ["f1", "f2"]
    assert fs.read_bytes("native/ns/a/b/f1") == b"one"
    fs.rename("native/ns/a/b/f2", "native/ns/a/b/f1")  # replaces
    assert fs.read_bytes("native/ns/a/b/f1") == b"two!"
    fs.remove("native/ns/a/b/f1")
    with pytest.raises(OSError) as err:
        fs.rmdir("native/ns/a")
    assert err.value.errno == errno.ENOTEMPTY
    fs.rmdir("native/ns/a/b")
    fs.rmdir("native/ns/a")
    assert fs.listdir("native/ns") == []


def test_errors_are_oserrors_with_errno(fs: FileSystem) -> None:
    fs.makedirs("native/err", exist_ok=True)
    with pytest.raises(FileNotFoundError) as err:
        fs.read_bytes("native/err/missing")
    assert err.value.filename == "native/err/missing"
    with pytest.raises(IsADirectoryError):
        fs.read_bytes("native/err")
    with pytest.raises(IsADirectoryError):
        fs.open("native/err", "wb")
    fs.write_bytes("native/err/file", b"x")
    with pytest.raises(FileExistsError):
        fs.open("native/err/file", "xb")
    with pytest.raises(NotADirectoryError):
        fs.listdir("native/err/file")
    with pytest.raises(FileNotFoundError):
        fs.remove("native/err/missing")
    with pytest.raises(ValueError, match="mode"):
        fs.open("native/err/file", "w+")
    with pytest.raises(ValueError, match="mode"):
        fs.open("native/err/file", "rbt")
    with pytest.raises(ValueError, match="unbuffered"):
        fs.open("native/err/file", "r", buffering=0)


def test_a_read_only_client_reads_and_refuses_every_change(lab, fs: FileSystem) -> None:
    fs.makedirs("native/ro/d", exist_ok=True)
    fs.write_bytes("native/ro/f", b"kept")
    with connect(lab.meta_addrs, "lab", secret=lab.credential("client"), read_only=True) as ro:
        assert ro.read_bytes("native/ro/f") == b"kept"
        with ro.open("native/ro/f") as f:
            assert f.read() == b"kept"
        changes = [
            lambda: ro.write_bytes("native/ro/new", b"x"),
            lambda: ro.open("native/ro/f", "r+b"),
            lambda: ro.open("native/ro/f", "ab"),
            lambda: ro.mkdir("native/ro/e"),
            lambda: ro.makedirs("native/ro/e/f"),
            lambda: ro.remove("native/ro/f"),
            lambda: ro.rmdir("native/ro/d"),
            lambda: ro.rename("native/ro/f", "native/ro/g"),
            lambda: ro.symlink("f", "native/ro/link"),
            lambda: ro.utime("native/ro/f"),
        ]
        for change in changes:
            with pytest.raises(OSError) as err:
                change()
            assert err.value.errno == errno.EROFS
    assert sorted(fs.listdir("native/ro")) == ["d", "f"]
    assert fs.read_bytes("native/ro/f") == b"kept"


def test_text_mode(fs: FileSystem) -> None:
    fs.makedirs("native", exist_ok=True)
    with fs.open("native/text.txt", "w") as f:
        f.write("eins\nzwei ü\n")
    assert fs.read_bytes("native/text.txt") == "eins\nzwei ü\n".encode()
    with fs.open("native/text.txt", "r") as f:  # text, like the builtin (the default is "rb")
        assert f.readlines() == ["eins\n", "zwei ü\n"]
    with fs.open("native/text.txt", "rb") as f:
        assert f.read(4) == b"eins"


def test_connect_errors(lab) -> None:
    with pytest.raises(FileNotFoundError):
        connect(lab.meta_addrs, "no-such-volume", secret=lab.credential("admin"))
    # The lab's client credential is for its volume alone.
    with pytest.raises(PermissionError, match="no credential for volume 'no-such-volume'"):
        connect(lab.meta_addrs, "no-such-volume", secret=lab.credential("client"))
    with pytest.raises(PermissionError):
        connect(lab.meta_addrs, "lab", secret=b"not the secret", connect_timeout=5)


def test_files_read_write_seek(fs: FileSystem) -> None:
    data = os.urandom(9 * MiB + 12345)  # over two 4 MiB blocks, not block aligned
    with fs.open("native/big.bin", "wb") as f:
        for off in range(0, len(data), 700_000):  # writes of odd sizes
            f.write(data[off : off + 700_000])
    assert fs.stat("native/big.bin").st_size == len(data)
    assert fs.read_bytes("native/big.bin") == data
    assert (
        fs.read_bytes("native/big.bin", 5 * MiB - 7, 5 * MiB + 9) == data[5 * MiB - 7 : 5 * MiB + 9]
    )
    assert fs.read_bytes("native/big.bin", -100) == data[-100:]
    assert fs.read_bytes("native/big.bin", 10, -10) == data[10:-10]
    assert fs.read_bytes("native/big.bin", len(data) + 5) == b""
    with fs.open("native/big.bin") as f:
        assert f.size == len(data)
        assert f.read(1000) == data[:1000]
        f.seek(4 * MiB - 3)
        assert f.read(6) == data[4 * MiB - 3 : 4 * MiB + 3]
        f.seek(-5, os.SEEK_END)
        assert f.read() == data[-5:]
        assert f.read() == b""
    with fs.open("native/big.bin", "rb", buffering=0) as raw:
        assert raw.pread(7 * MiB, 10) == data[7 * MiB : 7 * MiB + 10]
        buf = bytearray(100)
        assert raw.readinto(buf) == 100 and bytes(buf) == data[:100]
    # append, then overwrite in place, then truncate by reopening with wb
    with fs.open("native/big.bin", "ab") as f:
        f.write(b"tail")
    with fs.open("native/big.bin", "r+b") as f:
        f.seek(MiB)
        f.write(b"XYZ")
    want = bytearray(data + b"tail")
    want[MiB : MiB + 3] = b"XYZ"
    assert fs.read_bytes("native/big.bin") == bytes(want)
    with fs.open("native/big.bin", "wb") as f:
        f.write(b"short")
    assert fs.read_bytes("native/big.bin") == b"short"
    fs.remove("native/big.bin")


def test_two_clients_close_to_open(lab, fs: FileSystem) -> None:
    with connect(lab.meta_addrs, "lab", secret=lab.credential("client"), zone="z2") as other:
        fs.write_bytes("native/shared", b"first version")
        assert other.read_bytes("native/shared") == b"first version"
        f = fs.open("native/shared", "wb")
        f.write(b"second")
        f.flush()  # committed at flush, before close
        assert other.read_bytes("native/shared") == b"second"
        f.close()
        # other's L1 holds the old blocks; a new version names new blocks
        fs.write_bytes("native/shared", b"third version, longer")
        assert other.read_bytes("native/shared") == b"third version, longer"


def test_many_threads_share_one_client(fs: FileSystem) -> None:
    import concurrent.futures

    fs.makedirs("native/threads", exist_ok=True)
    blobs = {f"native/threads/{i}": os.urandom(50_000 + i) for i in range(24)}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: fs.write_bytes(*kv), blobs.items()))
        got = dict(zip(blobs, pool.map(fs.read_bytes, blobs), strict=True))
    assert got == blobs
    assert len(fs.listdir("native/threads")) == 24


async def test_trio_native_entry_points(lab) -> None:
    async with open_volume(lab.meta_addrs, "lab", secret=lab.credential("client"), zone="z1") as afs:
        await afs.makedirs("native/aio", exist_ok=True)
        payload = os.urandom(3 * MiB)
        async with await afs.open("native/aio/f", "wb") as f:
            await f.write(payload[:MiB])
            await f.write(payload[MiB:])
        assert (await afs.stat("native/aio/f")).st_size == len(payload)
        results: dict[int, bytes] = {}

        async def part(i: int) -> None:
            results[i] = await afs.read_bytes("native/aio/f", i * MiB, (i + 1) * MiB)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(part, i)
        assert b"".join(results[i] for i in range(3)) == payload
        async with await afs.open("native/aio/f") as f:
            assert await f.read() == payload
        assert [p async for p, _, _ in afs.walk("native/aio")] == ["/native/aio"]
        with pytest.raises(FileNotFoundError):
            await afs.stat("native/aio/none")


def test_repeat_reads_come_from_l1(lab) -> None:
    with connect(lab.meta_addrs, "lab", secret=lab.credential("client"), zone="z1") as c:
        c.makedirs("native", exist_ok=True)
        data = os.urandom(6 * MiB)
        c.write_bytes("native/l1", data)
        assert c.read_bytes("native/l1") == data
        fetched = c.stats()["block_fetches"]
        for _ in range(3):
            assert c.read_bytes("native/l1") == data
        s = c.stats()
        assert s["block_fetches"] == fetched  # nothing went to the cluster again
        assert s["l1_hit_bytes"] >= 3 * len(data)


def test_a_stream_larger_than_l1_receives_into_the_buffers_l1_let_go(lab) -> None:
    """Each block L1 evicts, held by nothing else, receives a later block (no
    new 4 MiB buffer per block), and every byte read is still the file's."""
    with connect(lab.meta_addrs, "lab", secret=lab.credential("client"), zone="z1",
                 l1_bytes=8 * MiB) as c:
        c.makedirs("native", exist_ok=True)
        data = os.urandom(40 * MiB)
        c.write_bytes("native/stream", data)
        for _ in range(2):
            with c.open("native/stream", "rb") as f:
                assert b"".join(iter(lambda: f.read(MiB), b"")) == data
        s = c.stats()
        assert s["buffers_reused"] > 0, s


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.needs_fuse
def test_library_and_mount_read_the_same_bytes(fs: FileSystem, mount: Path) -> None:
    """Files written through the mount read the same through the library, and
    files written through the library read the same through the mount."""
    (mount / "cmp").mkdir(exist_ok=True)
    sizes = [0, 1, 4095, 1 * MiB + 17, 4 * MiB, 9 * MiB + 3]
    by_mount = {f"m{i}": os.urandom(n) for i, n in enumerate(sizes)}
    for name, data in by_mount.items():
        (mount / "cmp" / name).write_bytes(data)
    by_lib = {f"l{i}": os.urandom(n) for i, n in enumerate(sizes)}
    for name, data in by_lib.items():
        fs.write_bytes(f"cmp/{name}", data)
    drop_page_cache()
    assert sorted(fs.listdir("cmp")) == sorted(os.listdir(mount / "cmp"))
    for name, data in {**by_mount, **by_lib}.items():
        via_lib = fs.read_bytes(f"cmp/{name}")
        via_mount = (mount / "cmp" / name).read_bytes()
        assert via_lib == via_mount == data, name
        st_lib, st_mount = fs.stat(f"cmp/{name}"), (mount / "cmp" / name).stat()
        assert (st_lib.st_ino, st_lib.st_size, st_lib.st_mode) == (
            st_mount.st_ino,
            st_mount.st_size,
            st_mount.st_mode,
        )
    # ranges, through a file object on each side
    with open(mount / "cmp" / "m5", "rb") as fm, fs.open("cmp/m5") as fl:
        for off, n in [(0, 10), (4 * MiB - 5, 10), (7 * MiB, MiB), (9 * MiB, 100)]:
            fm.seek(off)
            fl.seek(off)
            assert fm.read(n) == fl.read(n)


@pytest.mark.needs_fuse
def test_library_writes_are_visible_to_the_mount(fs: FileSystem, mount: Path) -> None:
    fs.makedirs("ckpt/step1", exist_ok=True)
    blob = os.urandom(5 * MiB + 1)
    with fs.open("ckpt/step1/model.pt", "wb") as f:
        f.write(blob)
    assert (mount / "ckpt" / "step1" / "model.pt").read_bytes() == blob
    # an overwrite (same inode, new content version) reaches the mount's next open
    fs.write_bytes("ckpt/step1/model.pt", blob[::-1])
    time.sleep(0.3)  # past the mount's attribute timeout (0.2 s), as for any other client
    assert (mount / "ckpt" / "step1" / "model.pt").read_bytes() == blob[::-1]
    fs.rename("ckpt/step1", "ckpt/final")
    time.sleep(0.3)
    assert os.listdir(mount / "ckpt") == ["final"]
    # and the mount's writes reach the library's next open
    (mount / "ckpt" / "final" / "model.pt").write_bytes(b"from the mount")
    assert fs.read_bytes("ckpt/final/model.pt") == b"from the mount"
    fs.symlink("final/model.pt", "ckpt/latest")
    assert os.readlink(mount / "ckpt" / "latest") == "final/model.pt"
    assert (mount / "ckpt" / "latest").read_bytes() == b"from the mount"
    os.symlink("final", mount / "ckpt" / "dirlink")
    assert fs.read_bytes("ckpt/dirlink/model.pt") == b"from the mount"


def test_a_forked_child_connects_on_its_own(lab) -> None:
    """The parent's client does not work in a child (no loop thread there), is
    dropped there without touching the parent's loop, and the child's own
    connection works; the parent's client goes on working."""
    import gc

    c = connect(lab.meta_addrs, "lab", secret=lab.credential("client"), zone="z1")
    c.write_bytes("native/fork", b"parent")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            try:
                c.read_bytes("native/fork")
                code = 2
            except RuntimeError:
                del c
                gc.collect()
                with connect(lab.meta_addrs, "lab", secret=lab.credential("client")) as own:
                    code = 0 if own.read_bytes("native/fork") == b"parent" else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert c.read_bytes("native/fork") == b"parent"
    c.close()
    assert c.closed
    with pytest.raises(ValueError, match="closed"):
        c.stat("native/fork")


def test_many_small_writes_are_compacted(fs: FileSystem) -> None:
    """Each committed run is a slice; at ``compact_after`` the chunk is
    rewritten as one slice in the background, and the bytes stay the same.

    The last commit is the one that reaches the threshold, so the compaction
    cannot start (and end) between two of them, leaving the later ones as
    slices of their own: whatever the scheduler does, the chunk ends as one.
    """
    threshold = fs.aio.options.compact_after
    want = bytearray(64 * 1024)
    fs.makedirs("native", exist_ok=True)
    with fs.open("native/compact", "wb") as f:
        f.write(bytes(want))  # the first slice
    with fs.open("native/compact", "r+b", buffering=0) as f:
        for i in range(threshold - 1):
            piece = bytes([i + 1]) * 100
            f.seek(i * 900)
            f.write(piece)
            f.flush()  # one committed slice each
            want[i * 900 : i * 900 + 100] = piece
    ino = fs.stat("native/compact").st_ino

    async def slices() -> int:
        return len(await fs.aio.session.read_chunk(ino, 0))

    deadline = time.monotonic() + 60  # a bound for a loaded machine: the loop ends at the compaction
    while fs.call(slices) > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fs.call(slices) == 1
    assert fs.read_bytes("native/compact") == bytes(want)


def test_symbolic_links_are_followed(fs: FileSystem) -> None:
    fs.makedirs("native/links/real/deep", exist_ok=True)
    fs.write_bytes("native/links/real/deep/f", b"target bytes")
    fs.symlink("real/deep", "native/links/rel")  # relative to the link's directory
    fs.symlink("/native/links/real", "native/links/abs")
    fs.symlink("../rel/f", "native/links/real/up")  # '..' inside a target
    fs.symlink("loop2", "native/links/loop1")
    fs.symlink("loop1", "native/links/loop2")
    fs.symlink("nowhere", "native/links/dangling")
    assert fs.read_bytes("native/links/rel/f") == b"target bytes"
    assert fs.read_bytes("native/links/abs/deep/f") == b"target bytes"
    assert fs.read_bytes("native/links/real/up") == b"target bytes"
    assert sorted(fs.listdir("native/links/abs")) == ["deep", "up"]
    assert fs.stat("native/links/rel").st_ino == fs.stat("native/links/real/deep").st_ino
    assert stat.S_ISLNK(fs.lstat("native/links/rel").st_mode)
    assert fs.readlink("native/links/rel") == "real/deep"
    with pytest.raises(OSError) as err:
        fs.readlink("native/links/real")
    assert err.value.errno == errno.EINVAL
    with pytest.raises(OSError) as err:
        fs.stat("native/links/loop1")
    assert err.value.errno == errno.ELOOP
    assert not fs.exists("native/links/dangling") and stat.S_ISLNK(
        fs.lstat("native/links/dangling").st_mode
    )
    fs.write_bytes("native/links/abs/new", b"through a link")  # parent reached through a link
    assert fs.read_bytes("native/links/real/new") == b"through a link"
    fs.makedirs("native/links/abs/deep", exist_ok=True)  # an existing directory behind a link
    entries = {e.name: e for e in fs.scandir("native/links")}
    assert stat.S_ISLNK(entries["rel"].stat.st_mode) and not entries["rel"].is_dir()
