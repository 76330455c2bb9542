"""The power-cut model: what survives a power cut, and what does not.

Each case runs the operations on a :class:`VolatileFS`, then "cuts power"
(drops the object, loads a new one from the same backing directory), and
looks at what is left. The property test checks the model against an
independent reference (dicts, no pages, no disk) over random operations
with power cuts in between.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefs.testing.volatile import PAGE, ROOT, Dir, File, VolatileFS


class Disk:
    """Path-based calls on a VolatileFS, and the power cut."""

    def __init__(self, backing: Path) -> None:
        self.backing = backing
        self.fs = VolatileFS(backing)

    def cut(self) -> None:
        self.fs.close_all()
        self.fs = VolatileFS(self.backing)

    def ino(self, path: str) -> int:
        ino = ROOT
        for part in filter(None, path.split("/")):
            ino = self.fs.lookup(ino, part).ino
        return ino

    def _parent(self, path: str) -> tuple[int, str]:
        head, _, name = path.rpartition("/")
        return self.ino(head), name

    def mkdir(self, path: str) -> None:
        self.fs.mkdir(*self._parent(path), 0o755)

    def write(self, path: str, data: bytes, offset: int = 0) -> None:
        parent, name = self._parent(path)
        try:
            ino = self.fs.lookup(parent, name).ino
        except FileNotFoundError:
            ino = self.fs.create(parent, name, 0o644).ino
        self.fs.open(ino)
        try:
            self.fs.write(ino, offset, data)
        finally:
            self.fs.close(ino)

    def read(self, path: str) -> bytes:
        ino = self.ino(path)
        self.fs.open(ino)
        try:
            return self.fs.read(ino, 0, 1 << 30)
        finally:
            self.fs.close(ino)

    def fsync(self, path: str = "") -> None:
        self.fs.fsync(self.ino(path))

    def rename(self, old: str, new: str) -> None:
        self.fs.rename(*self._parent(old), *self._parent(new))

    def unlink(self, path: str) -> None:
        self.fs.unlink(*self._parent(path))

    def link(self, old: str, new: str) -> None:
        self.fs.link(self.ino(old), *self._parent(new))

    def truncate(self, path: str, size: int) -> None:
        self.fs.truncate(self.ino(path), size)

    def image(self) -> dict[str, bytes | None]:
        """Every path: a file's bytes, or None for a directory."""
        out: dict[str, bytes | None] = {}
        stack = [("", ROOT)]
        while stack:
            prefix, ino = stack.pop()
            for name, node in self.fs.listdir(ino):
                path = f"{prefix}{name}"
                if isinstance(node, Dir):
                    out[path] = None
                    stack.append((path + "/", node.ino))
                else:
                    out[path] = self.read(path)
        return out


@pytest.fixture
def disk(tmp_path: Path) -> Disk:
    return Disk(tmp_path / "disk")


def test_fsynced_data_survives_and_unsynced_does_not(disk: Disk) -> None:
    disk.write("f", b"A" * 10000)
    disk.fsync("f")
    disk.fsync("")
    disk.write("f", b"B" * 5000, offset=8000)  # overwrites and extends, never fsynced
    disk.write("g", b"unsynced")
    assert disk.read("f") == b"A" * 8000 + b"B" * 5000
    disk.cut()
    assert disk.image() == {"f": b"A" * 10000}


def test_a_new_file_needs_its_directory_fsynced(disk: Disk) -> None:
    disk.write("f", b"data")
    disk.fsync("f")
    disk.cut()
    assert disk.image() == {}
    assert list((disk.backing / "inodes").iterdir()) == []  # its bytes are not kept either


def test_a_name_made_durable_before_the_data_is_an_empty_file(disk: Disk) -> None:
    disk.write("f", b"data")
    disk.fsync("")
    disk.cut()
    assert disk.image() == {"f": b""}


def test_rename_without_directory_fsync_rolls_back(disk: Disk) -> None:
    disk.write("old", b"old")
    disk.fsync("old")
    disk.fsync("")
    disk.write("tmp", b"new")
    disk.fsync("tmp")
    disk.rename("tmp", "old")  # the atomic-replace pattern, missing its last step
    assert disk.image() == {"old": b"new"}
    disk.cut()
    assert disk.image() == {"old": b"old"}
    disk.write("tmp", b"new")
    disk.fsync("tmp")
    disk.rename("tmp", "old")
    disk.fsync("")
    disk.cut()
    assert disk.image() == {"old": b"new"}


def test_cross_directory_rename_is_durable_where_fsynced(disk: Disk) -> None:
    disk.mkdir("tmp")
    disk.mkdir("dst")
    disk.fsync("")
    disk.write("tmp/f", b"x")
    disk.fsync("tmp/f")
    disk.fsync("tmp")
    disk.rename("tmp/f", "dst/f")
    disk.fsync("dst")  # not tmp: the old name is still durable too (a hard link)
    disk.cut()
    assert disk.image() == {"tmp": None, "tmp/f": b"x", "dst": None, "dst/f": b"x"}
    disk.unlink("tmp/f")
    disk.fsync("tmp")
    disk.cut()
    assert disk.image() == {"tmp": None, "dst": None, "dst/f": b"x"}


def test_files_in_a_directory_whose_mkdir_was_not_fsynced_are_lost(disk: Disk) -> None:
    disk.mkdir("shards")
    disk.mkdir("shards/ab")
    disk.write("shards/ab/s", b"shard")
    disk.fsync("shards/ab/s")
    disk.fsync("shards/ab")
    disk.fsync("shards")  # but not the root: "shards" itself is not durable
    disk.cut()
    assert disk.image() == {}
    disk.mkdir("shards")
    disk.mkdir("shards/ab")
    disk.write("shards/ab/s", b"shard")
    disk.fsync("shards/ab/s")
    disk.fsync("shards/ab")
    disk.fsync("")  # both parents now, in either order
    disk.fsync("shards")
    disk.cut()
    assert disk.image() == {"shards": None, "shards/ab": None, "shards/ab/s": b"shard"}


def test_unlink_and_truncate_roll_back_without_fsync(disk: Disk) -> None:
    disk.write("f", bytes(range(256)) * 40)
    disk.write("g", b"g")
    disk.fsync("f")
    disk.fsync("g")
    disk.fsync("")
    disk.truncate("f", 100)
    disk.truncate("f", PAGE * 3)  # grown again: the cut-off bytes read as zeros
    assert disk.read("f") == bytes(range(100)) + bytes(PAGE * 3 - 100)
    disk.unlink("g")
    disk.cut()
    assert disk.image() == {"f": bytes(range(256)) * 40, "g": b"g"}
    disk.truncate("f", 100)
    disk.fsync("f")
    disk.cut()
    assert disk.image() == {"f": bytes(range(100)), "g": b"g"}
    disk.write("f", b"\xff" * 10, offset=50)
    disk.truncate("f", 55)  # inside a dirty page
    disk.truncate("f", 20)  # below the durable size
    disk.write("f", b"!", offset=PAGE + 1)  # grown again past both, then made durable
    disk.fsync("f")
    want = bytes(range(20)) + bytes(PAGE + 1 - 20) + b"!"
    assert disk.read("f") == want
    disk.cut()
    assert disk.image() == {"f": want, "g": b"g"}


def test_truncated_durable_bytes_stay_hidden_and_sparse_pages_land_in_place(disk: Disk) -> None:
    disk.write("f", b"\xaa" * (4 * PAGE))
    disk.fsync("f")
    disk.fsync("")
    disk.truncate("f", 10)  # pages 1-3 are durable but must read as zeros from here on
    disk.write("f", b"!", offset=PAGE + 5)  # a partial page over hidden bytes
    disk.write("f", b"?" * PAGE, offset=3 * PAGE)  # not contiguous with page 1
    want = b"\xaa" * 10 + bytes(PAGE - 5) + b"!" + bytes(2 * PAGE - 6) + b"?" * PAGE
    assert disk.read("f") == want
    disk.fsync("f")
    disk.cut()
    assert disk.image() == {"f": want}


def test_an_unlinked_open_file_keeps_answering_and_then_goes(disk: Disk) -> None:
    disk.write("f", b"still here")
    disk.fsync("f")
    disk.fsync("")
    ino = disk.ino("f")
    disk.fs.open(ino)
    disk.unlink("f")
    disk.fsync("")
    assert disk.fs.read(ino, 0, 100) == b"still here"
    disk.fs.close(ino)
    assert ino not in disk.fs.table
    assert list((disk.backing / "inodes").iterdir()) == []


def test_directory_rename_moves_with_either_parent(disk: Disk) -> None:
    disk.mkdir("a")
    disk.mkdir("b")
    disk.mkdir("a/d")
    disk.write("a/d/f", b"f")
    disk.fsync("a/d/f")
    disk.fsync("a/d")
    disk.fsync("a")
    disk.fsync("")
    disk.rename("a/d", "b/d")
    disk.cut()
    assert disk.image() == {"a": None, "a/d": None, "a/d/f": b"f", "b": None}
    disk.rename("a/d", "b/e")
    disk.fsync("a")  # the source only: the rename is one step, so d is now b/e
    disk.cut()
    assert disk.image() == {"a": None, "b": None, "b/e": None, "b/e/f": b"f"}


def test_errors_are_the_syscalls(disk: Disk) -> None:
    disk.mkdir("d")
    disk.write("d/f", b"x")
    with pytest.raises(FileExistsError):
        disk.mkdir("d")
    with pytest.raises(FileNotFoundError):
        disk.write("nope/f", b"x")
    with pytest.raises(OSError) as exc:
        disk.fs.rmdir(ROOT, "d")
    assert exc.value.errno == errno.ENOTEMPTY
    with pytest.raises(IsADirectoryError):
        disk.unlink("d")
    with pytest.raises(OSError) as exc:
        disk.fs.rename(ROOT, "d", disk.ino("d"), "x")
    assert exc.value.errno == errno.EINVAL


# ---------------------------------------------------------------- against a reference


class Reference:
    """The same rules, written as plainly as possible: dicts of bytes and names."""

    def __init__(self) -> None:
        self._n = 1
        self.data: dict[int, bytes] = {}  # file id -> current bytes
        self.durable_data: dict[int, bytes] = {}
        self.entries: dict[int, dict[str, int]] = {0: {}}  # dir id -> name -> id
        self.durable_entries: dict[int, dict[str, int]] = {0: {}}

    def _walk(self, path: str) -> int:
        node = 0
        for part in filter(None, path.split("/")):
            if node not in self.entries:
                raise OSError(errno.ENOTDIR, path)
            if part not in self.entries[node]:
                raise OSError(errno.ENOENT, path)
            node = self.entries[node][part]
        return node

    def _parent(self, path: str) -> tuple[int, str]:
        head, _, name = path.rpartition("/")
        parent = self._walk(head)
        if parent not in self.entries:
            raise OSError(errno.ENOTDIR, path)
        return parent, name

    def _new(self) -> int:
        self._n += 1
        return self._n

    def mkdir(self, path: str) -> None:
        parent, name = self._parent(path)
        if name in self.entries[parent]:
            raise OSError(errno.EEXIST, path)
        d = self.entries[parent][name] = self._new()
        self.entries[d], self.durable_entries[d] = {}, {}

    def write(self, path: str, data: bytes, offset: int) -> None:
        parent, name = self._parent(path)
        f = self.entries[parent].get(name)
        if f is None:
            f = self.entries[parent][name] = self._new()
            self.data[f] = b""
        if f in self.entries:
            raise OSError(errno.EISDIR, path)
        old = self.data[f].ljust(offset, b"\0")
        self.data[f] = old[:offset] + data + old[offset + len(data):]

    def _file(self, path: str) -> int:
        f = self._walk(path)
        if f in self.entries:
            raise OSError(errno.EISDIR, path)
        return f

    def truncate(self, path: str, size: int) -> None:
        f = self._file(path)
        self.data[f] = self.data[f][:size].ljust(size, b"\0")

    def fsync(self, path: str) -> None:
        node = self._walk(path)
        if node in self.entries:
            self.durable_entries[node] = dict(self.entries[node])
        else:
            self.durable_data[node] = self.data[node]

    def rename(self, old: str, new: str) -> None:
        src, name = self._parent(old)
        f = self._file(old)
        dst, new_name = self._parent(new)
        target = self.entries[dst].get(new_name)
        if target in self.entries:
            raise OSError(errno.EISDIR, new)
        if target == f:
            return
        del self.entries[src][name]
        self.entries[dst][new_name] = f

    def unlink(self, path: str) -> None:
        parent, name = self._parent(path)
        self._file(path)
        del self.entries[parent][name]

    def link(self, old: str, new: str) -> None:
        f = self._file(old)
        dst, name = self._parent(new)
        if name in self.entries[dst]:
            raise OSError(errno.EEXIST, new)
        self.entries[dst][name] = f

    def cut(self) -> None:
        """Keep what the durable names reach, with the durable bytes."""
        entries: dict[int, dict[str, int]] = {}
        data: dict[int, bytes] = {}
        stack = [0]
        while stack:
            d = stack.pop()
            entries[d] = dict(self.durable_entries[d])
            for child in entries[d].values():
                if child in self.entries:
                    stack.append(child)
                else:
                    data[child] = self.durable_data.get(child, b"")
        self.entries = entries
        self.durable_entries = {d: dict(e) for d, e in entries.items()}
        self.data, self.durable_data = data, dict(data)

    def image(self) -> dict[str, bytes | None]:
        out: dict[str, bytes | None] = {}
        stack = [("", 0)]
        while stack:
            prefix, d = stack.pop()
            for name, child in self.entries[d].items():
                if child in self.entries:
                    out[prefix + name] = None
                    stack.append((prefix + name + "/", child))
                else:
                    out[prefix + name] = self.data[child]
        return out


DIRS = ["a", "a/b", "c"]
FILES = [f"{d}{n}" for d in ["", "a/", "a/b/", "c/"] for n in ("x", "y")]
OPS = st.one_of(
    st.tuples(st.just("mkdir"), st.sampled_from(DIRS)),
    st.tuples(st.just("write"), st.sampled_from(FILES), st.integers(0, 3 * PAGE), st.integers(1, 2 * PAGE + 7)),
    st.tuples(st.just("truncate"), st.sampled_from(FILES), st.integers(0, 3 * PAGE)),
    st.tuples(st.just("fsync"), st.sampled_from(["", *DIRS, *FILES])),
    st.tuples(st.just("rename"), st.sampled_from(FILES), st.sampled_from(FILES)),
    st.tuples(st.just("unlink"), st.sampled_from(FILES)),
    st.tuples(st.just("link"), st.sampled_from(FILES), st.sampled_from(FILES)),
    st.tuples(st.just("cut")),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=40))
def test_model_matches_the_reference_across_power_cuts(tmp_path_factory: pytest.TempPathFactory, ops: list) -> None:
    disk, ref = Disk(tmp_path_factory.mktemp("vol")), Reference()
    for n, (op, *args) in enumerate(ops):
        if op == "write":
            path, offset, length = args
            args = [path, bytes([n % 251 + 1]) * length, offset]
        outcomes = []
        for target in (ref, disk):
            try:
                getattr(target, op)(*args)
                outcomes.append(None)
            except OSError as exc:
                outcomes.append(exc.errno)
        assert outcomes[0] == outcomes[1], (op, args, outcomes)
        assert disk.image() == ref.image(), (n, op, args)
    disk.cut()
    ref.cut()
    assert disk.image() == ref.image()
    files = [n for n in disk.fs.table.values() if isinstance(n, File)]
    assert sorted(p.name for p in (disk.backing / "inodes").iterdir()) == sorted(str(f.ino) for f in files)


def test_a_file_put_into_the_backing_tree_is_adopted(tmp_path: Path) -> None:
    (tmp_path / "disk" / "tree" / "d").mkdir(parents=True)
    (tmp_path / "disk" / "tree" / "d" / "f").write_bytes(b"by hand")
    disk = Disk(tmp_path / "disk")
    assert disk.image() == {"d": None, "d/f": b"by hand"}
    disk.write("d/f", b"BY")
    disk.cut()
    assert disk.image() == {"d": None, "d/f": b"by hand"}
    assert os.stat(tmp_path / "disk" / "tree" / "d" / "f").st_nlink == 2  # its data file too
