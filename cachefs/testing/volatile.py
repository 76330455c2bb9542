"""A filesystem that forgets what was not made durable: the model under the power-cut layer.

Theory of operation. Two states are kept side by side:

* the *current* state, what programs see: every inode, name and byte, held
  in memory (names and attributes) over the durable bytes (file data);
* the *durable* state, what a disk would still hold after losing power. It
  lives in a real directory (``backing``)::

      backing/tree/...     the durable namespace, laid out as it would be after a power cut
      backing/inodes/<n>   the durable bytes of inode n (the names in tree/ are hard links)

A change moves from current to durable only the way it does on a
conservative POSIX disk:

* file data, size and mode: by ``fsync``/``fdatasync`` of that file (one
  rule for both: fdatasync too must persist the size that reads need);
* a name (create, mkdir, link, rename, unlink, rmdir): by ``fsync`` of the
  directory that holds it, and only for that directory. A file renamed from
  ``tmp/`` into ``a/`` and ``a`` fsynced is durable under ``a/`` and, until
  ``tmp/`` is fsynced too, also still under ``tmp/`` (as a hard link);
* a name made durable before the inode's data was fsynced points at the
  bytes last fsynced, so a never-fsynced file comes back empty (the
  ext4 zero-length-file case);
* a directory's own name in its parent needs the parent's fsync, so a shard
  file fsynced into a directory whose ``mkdir`` never was is lost with it.

Where ext4 is atomic and two directories take part (a directory renamed
from one parent to another), the model is too: the first fsync of either
parent moves it, since a directory cannot durably sit in two places.

Nothing else ever reaches ``backing``: writes, creates, renames and
truncates wait in memory (file data as 4 KiB dirty pages over the durable
bytes). So losing the process that holds this object *is* the power cut, at
any instant: a fresh :class:`VolatileFS` on the same ``backing`` loads the
durable state, drops inodes whose data was fsynced but whose name never was,
and sees exactly what the disk would. :meth:`sync_all` is a clean shutdown.

Blocking file IO; not thread-safe (the FUSE front end calls it from one trio
thread). Errors are ``OSError`` with the errno the syscall would give.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PAGE = 4096
ROOT = 1  # the root directory's inode number (pyfuse3.ROOT_INODE)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # renameat2 flags, as the kernel sends them


def _err(code: int, what: str = "") -> OSError:
    return OSError(code, os.strerror(code) + (f": {what}" if what else ""))


@dataclass(eq=False)
class Node:
    ino: int
    mode: int
    uid: int = 0
    gid: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    nlink: int = 0  # current names
    holds: int = 0  # kernel lookups and open handles: the inode must stay while any is held

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    def touch(self, *, data: bool = True) -> None:
        now = time.time_ns()
        self.ctime_ns = now
        if data:
            self.mtime_ns = now


@dataclass(eq=False)
class File(Node):
    size: int = 0  # current
    dsize: int = 0  # durable (the data file's size)
    valid: int = 0  # durable bytes below this still show through clean pages (truncation hides the rest)
    dirty: dict[int, bytearray] = field(default_factory=dict)  # page index -> current page
    has_data: bool = False  # backing/inodes/<ino> exists
    drefs: int = 0  # durable names (entries in some directory's durable listing)
    opens: int = 0  # open handles (also counted in holds)
    fd: int = -1  # the data file, kept open while handles are


@dataclass(eq=False)
class Dir(Node):
    entries: dict[str, Node] = field(default_factory=dict)  # current
    durable: dict[str, Node] = field(default_factory=dict)  # as of this directory's last fsync
    parent: Dir | None = None  # current
    dparent: tuple[Dir, str] | None = None  # where it durably is (its name in its parent's durable listing)

    @property
    def subdirs(self) -> int:
        return sum(1 for n in self.entries.values() if n.is_dir)


class VolatileFS:
    """The current and the durable state of one filesystem (see the module doc)."""

    def __init__(self, backing: str | os.PathLike[str]) -> None:
        self.backing = Path(backing)
        self._tree = self.backing / "tree"
        self._inodes = self.backing / "inodes"
        self._tree.mkdir(parents=True, exist_ok=True)
        self._inodes.mkdir(exist_ok=True)
        self.table: dict[int, Node] = {}
        self._next = ROOT + 1
        self._load()

    # ------------------------------------------------------------ start-up

    def _load(self) -> None:
        """The durable state as the current one; unnamed data files are dropped."""
        by_st_ino: dict[int, int] = {}
        for entry in os.scandir(self._inodes):
            if entry.name.isdigit():
                by_st_ino[entry.stat().st_ino] = int(entry.name)
                self._next = max(self._next, int(entry.name) + 1)
        files: dict[int, File] = {}
        root = self._dir_from(ROOT, os.stat(self._tree), None, None)
        stack = [(root, self._tree)]
        while stack:
            d, path = stack.pop()
            for entry in os.scandir(path):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    child: Node = self._dir_from(self._new_ino(), st, d, entry.name)
                    stack.append((child, Path(entry.path)))  # type: ignore[arg-type]
                elif stat.S_ISREG(st.st_mode):
                    ino = by_st_ino.get(st.st_ino)
                    if ino is None:  # a file put into the tree by hand: adopt it
                        ino = by_st_ino[st.st_ino] = self._new_ino()
                        os.link(entry.path, self._inodes / str(ino))
                    f = files.get(ino)
                    if f is None:
                        f = files[ino] = File(ino, st.st_mode, st.st_uid, st.st_gid, st.st_atime_ns,
                                              st.st_mtime_ns, st.st_ctime_ns, size=st.st_size,
                                              dsize=st.st_size, valid=st.st_size, has_data=True)
                        self.table[ino] = f
                    f.nlink += 1
                    f.drefs += 1
                    child = f
                else:
                    log.warning("power-cut layer: ignoring %s (only files and directories)", entry.path)
                    continue
                d.entries[entry.name] = d.durable[entry.name] = child
        for ino in set(by_st_ino.values()) - set(files):
            (self._inodes / str(ino)).unlink()  # fsynced, but never named durably: lost

    def _dir_from(self, ino: int, st: os.stat_result, parent: Dir | None, name: str | None) -> Dir:
        d = Dir(ino, st.st_mode, st.st_uid, st.st_gid, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns,
                nlink=1, parent=parent, dparent=(parent, name) if parent and name else None)
        self.table[ino] = d
        return d

    def _new_ino(self) -> int:
        ino, self._next = self._next, self._next + 1
        return ino

    # ------------------------------------------------------------ lookups and lifetime

    def node(self, ino: int) -> Node:
        try:
            return self.table[ino]
        except KeyError:
            raise _err(errno.ENOENT, f"inode {ino}") from None

    def _dir(self, ino: int) -> Dir:
        d = self.node(ino)
        if not isinstance(d, Dir):
            raise _err(errno.ENOTDIR)
        return d

    def _file(self, ino: int) -> File:
        f = self.node(ino)
        if not isinstance(f, File):
            raise _err(errno.EISDIR)
        return f

    def lookup(self, parent: int, name: str) -> Node:
        d = self._dir(parent)
        if name == ".":
            return d
        if name == "..":
            return d.parent or d
        try:
            return d.entries[name]
        except KeyError:
            raise _err(errno.ENOENT, name) from None

    def listdir(self, ino: int) -> list[tuple[str, Node]]:
        return sorted(self._dir(ino).entries.items())

    def hold(self, ino: int, n: int = 1) -> None:
        self.node(ino).holds += n

    def release(self, ino: int, n: int = 1) -> None:
        node = self.table.get(ino)
        if node is None:
            return
        node.holds -= n
        self._maybe_forget(node)

    def _maybe_forget(self, node: Node) -> None:
        if node.nlink > 0 or node.holds > 0 or node.ino == ROOT:
            return
        self.table.pop(node.ino, None)
        if isinstance(node, File):
            node.dirty.clear()
            self._maybe_drop_data(node)

    def _maybe_drop_data(self, f: File) -> None:
        """Delete a data file nothing can reach any more (no name, durable or current, no handle)."""
        if f.has_data and f.drefs == 0 and f.nlink == 0 and f.holds == 0:
            (self._inodes / str(f.ino)).unlink(missing_ok=True)
            f.has_data = False

    # ------------------------------------------------------------ namespace (current state)

    def _new_name(self, parent: int, name: str) -> Dir:
        d = self._dir(parent)
        if d.nlink == 0:
            raise _err(errno.ENOENT, "directory was removed")
        if name in d.entries:
            raise _err(errno.EEXIST, name)
        if not name or "/" in name or name in (".", ".."):
            raise _err(errno.EINVAL, repr(name))
        return d

    def mkdir(self, parent: int, name: str, mode: int, uid: int = 0, gid: int = 0) -> Dir:
        d = self._new_name(parent, name)
        now = time.time_ns()
        child = Dir(self._new_ino(), stat.S_IFDIR | stat.S_IMODE(mode), uid, gid, now, now, now,
                    nlink=1, parent=d)
        self.table[child.ino] = child
        d.entries[name] = child
        d.touch()
        return child

    def create(self, parent: int, name: str, mode: int, uid: int = 0, gid: int = 0) -> File:
        d = self._new_name(parent, name)
        now = time.time_ns()
        f = File(self._new_ino(), stat.S_IFREG | stat.S_IMODE(mode), uid, gid, now, now, now, nlink=1)
        self.table[f.ino] = f
        d.entries[name] = f
        d.touch()
        return f

    def link(self, ino: int, parent: int, name: str) -> File:
        f = self.node(ino)
        if not isinstance(f, File):
            raise _err(errno.EPERM, "hard link to a directory")
        if f.nlink == 0:
            raise _err(errno.ENOENT, "file was removed")
        d = self._new_name(parent, name)
        d.entries[name] = f
        f.nlink += 1
        f.touch(data=False)
        d.touch()
        return f

    def unlink(self, parent: int, name: str) -> None:
        d = self._dir(parent)
        node = self.lookup(parent, name)
        if node.is_dir:
            raise _err(errno.EISDIR, name)
        del d.entries[name]
        d.touch()
        self._drop_name(node)

    def rmdir(self, parent: int, name: str) -> None:
        d = self._dir(parent)
        node = self.lookup(parent, name)
        if not isinstance(node, Dir):
            raise _err(errno.ENOTDIR, name)
        if node.entries:
            raise _err(errno.ENOTEMPTY, name)
        del d.entries[name]
        d.touch()
        self._drop_name(node)

    def _drop_name(self, node: Node) -> None:
        node.nlink -= 1
        node.touch(data=False)
        if isinstance(node, Dir):
            node.nlink = 0
            node.parent = None
        self._maybe_forget(node)

    def rename(self, old_parent: int, old: str, new_parent: int, new: str, flags: int = 0) -> None:
        if flags & RENAME_EXCHANGE:
            raise _err(errno.EINVAL, "RENAME_EXCHANGE is not modelled")
        src, dst = self._dir(old_parent), self._dir(new_parent)
        node = self.lookup(old_parent, old)
        if not new or "/" in new or new in (".", ".."):
            raise _err(errno.EINVAL, repr(new))
        target = dst.entries.get(new)
        if target is node:
            return
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise _err(errno.EEXIST, new)
            if isinstance(target, Dir):
                if not node.is_dir:
                    raise _err(errno.EISDIR, new)
                if target.entries:
                    raise _err(errno.ENOTEMPTY, new)
            elif node.is_dir:
                raise _err(errno.ENOTDIR, new)
        if isinstance(node, Dir):
            up: Dir | None = dst
            while up is not None:
                if up is node:
                    raise _err(errno.EINVAL, "a directory cannot move into itself")
                up = up.parent
            node.parent = dst
        del src.entries[old]
        dst.entries[new] = node
        src.touch()
        dst.touch()
        node.touch(data=False)
        if target is not None:
            self._drop_name(target)

    # ------------------------------------------------------------ attributes

    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, atime_ns: int | None = None, mtime_ns: int | None = None,
                size: int | None = None) -> Node:
        node = self.node(ino)
        if size is not None:
            self.truncate(ino, size)
        if mode is not None:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        if atime_ns is not None:
            node.atime_ns = atime_ns
        if mtime_ns is not None:
            node.mtime_ns = mtime_ns
        node.touch(data=False)
        return node

    # ------------------------------------------------------------ file data (current state)

    def _data_fd(self, f: File) -> int:
        if f.fd < 0:
            f.fd = os.open(self._inodes / str(f.ino), os.O_RDWR | os.O_CREAT, 0o600)
            f.has_data = True
        return f.fd

    def open(self, ino: int) -> File:
        f = self._file(ino)
        f.opens += 1
        f.holds += 1
        return f

    def close(self, ino: int) -> None:
        f = self._file(ino)
        f.opens -= 1
        self._close_idle(f)
        self.release(ino)

    @staticmethod
    def _close_idle(f: File) -> None:
        if f.opens == 0 and f.fd >= 0:
            os.close(f.fd)
            f.fd = -1

    def _clean_page(self, f: File, index: int) -> bytearray:
        page = bytearray(PAGE)
        start = index * PAGE
        keep = min(f.valid - start, PAGE)
        if keep > 0 and f.has_data:
            raw = os.pread(self._data_fd(f), keep, start)
            page[: len(raw)] = raw
        return page

    def read(self, ino: int, offset: int, size: int) -> bytes:
        f = self._file(ino)
        end = min(offset + size, f.size)
        if end <= offset:
            return b""
        out = bytearray(end - offset)
        keep = min(end, f.valid)
        if keep > offset and f.has_data:
            raw = os.pread(self._data_fd(f), keep - offset, offset)
            out[: len(raw)] = raw
        if f.dirty:
            for index in range(offset // PAGE, (end - 1) // PAGE + 1):
                page = f.dirty.get(index)
                if page is not None:
                    start = index * PAGE
                    lo, hi = max(start, offset), min(start + PAGE, end)
                    out[lo - offset : hi - offset] = page[lo - start : hi - start]
        self._close_idle(f)
        return bytes(out)

    def write(self, ino: int, offset: int, data: bytes | memoryview) -> int:
        f = self._file(ino)
        view = memoryview(data)
        pos, end = offset, offset + len(view)
        while pos < end:
            index, start = divmod(pos, PAGE)
            n = min(PAGE - start, end - pos)
            piece = view[pos - offset : pos - offset + n]
            page = f.dirty.get(index)
            if page is None and n == PAGE:
                f.dirty[index] = bytearray(piece)
            else:
                if page is None:
                    page = f.dirty[index] = self._clean_page(f, index)
                page[start : start + n] = piece
            pos += n
        f.size = max(f.size, end)
        f.touch()
        self._close_idle(f)
        return len(view)

    def truncate(self, ino: int, size: int) -> None:
        f = self._file(ino)
        if size < 0:
            raise _err(errno.EINVAL, f"size {size}")
        if size < f.size:
            for index in [i for i in f.dirty if i * PAGE >= size]:
                del f.dirty[index]
            index, start = divmod(size, PAGE)
            page = f.dirty.get(index)
            if page is not None and start:
                page[start:] = bytes(PAGE - start)  # read back as zeros if the file grows again
            f.valid = min(f.valid, size)
        f.size = size
        f.touch()

    # ------------------------------------------------------------ durability

    def fsync(self, ino: int) -> None:
        """fsync/fdatasync of a file (its data, size, mode) or of a directory (its names)."""
        node = self.node(ino)
        if isinstance(node, File):
            self._sync_file(node)
        else:
            self._sync_dir(node)  # type: ignore[arg-type]

    def _sync_file(self, f: File) -> None:
        fd = self._data_fd(f)
        if f.valid < f.dsize:
            os.ftruncate(fd, f.valid)
        run_start, run = 0, bytearray()  # contiguous dirty pages go out in one pwrite
        for index in sorted(f.dirty):
            if run and index * PAGE != run_start + len(run):
                os.pwrite(fd, run, run_start)
                run = bytearray()
            if not run:
                run_start = index * PAGE
            run += f.dirty[index]
        if run:
            os.pwrite(fd, run, run_start)
        os.ftruncate(fd, f.size)  # the last page's tail past the size, or the size grown by truncate
        os.fchmod(fd, stat.S_IMODE(f.mode))
        f.dsize = f.valid = f.size
        f.dirty.clear()
        self._close_idle(f)

    def _tree_path(self, d: Dir) -> Path | None:
        """Where ``d`` durably is in ``backing/tree``, or None if it would not survive."""
        parts: list[str] = []
        while d.ino != ROOT:
            if d.dparent is None:
                return None
            d, name = d.dparent
            parts.append(name)
        return self._tree.joinpath(*reversed(parts))

    def _sync_dir(self, d: Dir) -> None:
        """Make ``d``'s current names its durable ones, and project them onto the tree."""
        for name, old in list(d.durable.items()):
            if d.durable.get(name) is not old or d.entries.get(name) is old:
                continue  # already moved by an earlier step, or unchanged
            if isinstance(old, Dir) and old.parent is not None:
                # Renamed (here or into another directory): a directory rename is
                # atomic, so it moves now, to wherever it currently is.
                new = next(k for k, v in old.parent.entries.items() if v is old)
                self._bind(old.parent, new, old)
            else:
                self._unbind(d, name)
        for name, node in d.entries.items():
            if d.durable.get(name) is not node:
                self._bind(d, name, node)

    def _unbind(self, d: Dir, name: str) -> None:
        here = self._tree_path(d)
        old = d.durable.pop(name)
        if isinstance(old, File):
            old.drefs -= 1
            if here is not None:
                (here / name).unlink()
            self._maybe_drop_data(old)
        elif isinstance(old, Dir):
            old.dparent = None
            if here is not None:
                shutil.rmtree(here / name)

    def _bind(self, d: Dir, name: str, node: Node) -> None:
        """``node`` durably named ``name`` in ``d`` (replacing what was)."""
        if name in d.durable:
            self._unbind(d, name)
        here = self._tree_path(d)
        d.durable[name] = node
        if isinstance(node, File):
            if not node.has_data:  # named durably before its data ever was: an empty file
                (self._inodes / str(node.ino)).touch(0o600)
                node.has_data = True
            node.drefs += 1
            if here is not None:
                os.link(self._inodes / str(node.ino), here / name)
            return
        assert isinstance(node, Dir)
        old_path = self._tree_path(node)
        if node.dparent is not None:  # durably elsewhere: it leaves there (one place only)
            other, other_name = node.dparent
            del other.durable[other_name]
        node.dparent = (d, name)
        if here is None:
            if old_path is not None:
                shutil.rmtree(old_path)
        elif old_path is not None:
            if here.is_relative_to(old_path):
                raise _err(errno.EIO, f"power-cut model: {old_path} cannot move into itself")
            os.rename(old_path, here / name)
        else:
            self._materialize(node, here / name)

    def _materialize(self, d: Dir, path: Path) -> None:
        """Create ``d``'s durable subtree at ``path`` (it just became reachable)."""
        os.mkdir(path, stat.S_IMODE(d.mode))
        for name, node in d.durable.items():
            if isinstance(node, File):
                os.link(self._inodes / str(node.ino), path / name)
            elif isinstance(node, Dir):
                self._materialize(node, path / name)

    def sync_all(self) -> None:
        """A clean shutdown: every file and directory reachable now made durable."""
        stack = [self.table[ROOT]]
        while stack:
            d = stack.pop()
            assert isinstance(d, Dir)
            self._sync_dir(d)
            for node in d.entries.values():
                if isinstance(node, File):
                    self._sync_file(node)
                else:
                    stack.append(node)

    def close_all(self) -> None:
        for node in self.table.values():
            if isinstance(node, File) and node.fd >= 0:
                os.close(node.fd)
                node.fd = -1
