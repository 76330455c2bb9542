"""Tree operations of the state machine: metadata-only clones (``cachefs tree
clone``) and deletes in the background (``cachefs tree delete``).

Theory of operation
-------------------
A clone copies inodes, never data. A copied file holds the same slice
records as its source, and each of their slices gains a holder in
``Volume.shared`` (see "Shared slices" in ``namespace.py``): blocks are
immutable, so a later write to either file makes new slices and leaves the
other alone, and a slice goes to the trash, where the collector may delete its
blocks, only when the last record holding it goes.

A directory is copied in bounded steps, each one log entry, so that no apply
holds every replica's state machine for long however big the tree is (the
``cachefs tree clone`` driver, ``cachefs/cli/tree.py``, walks the tree):

- ``CloneEntry`` copies one entry: a file, symlink or device whole, a
  directory as an empty copy with the same attributes;
- ``CloneDir`` copies up to ``limit`` entries of a source directory after a
  readdir cookie into its copy, and names the subdirectories it created, to
  be filled by further ``CloneDir`` steps.

Each step checks everything before its first write (names free, quotas of
the copy's directories, space, inode numbers), as every apply does. What a
step copies is the source as it is at that log index: a clone of a tree
that is being written to is not one point in time (clone a version that is
no longer written, as dataset versions are). Hard links inside the tree
become separate files in the copy, as ``cp -r`` makes them. Files imported
from S3 are not cloned (their slices name objects of a link, which one file
owns): a step that meets one, or a source or destination inside a linked
directory, is refused. Copies count in quotas and in the volume's usage as
their sources do (JuiceFS counts clones so too): a clone of a subtree needs
the room the subtree takes, and deleting either copy frees it again.

A tree delete is fast for the caller however big the tree: ``DeleteTree``
takes the directory out of the namespace in one step (its usage leaves its
ancestors' with it) and lists it in ``Volume.doomed``, where it is a root of
its own, unreachable by path. The leader then proposes ``PurgeTree`` steps
(``MetaService.run_tree_deletes``), each removing up to ``limit`` inodes
deepest first, until the tree is gone; the list is replicated, so a new
leader goes on where the old one stopped. Files leave as an unlink leaves
them: their slices go to the trash (the collector deletes the blocks of
those no other file holds), or, if a session may have them open (the leader
did not list them in ``free``), they stay as orphans until the last close.
The directory's subtree usage, kept as always, says how much is left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cachefs import commands as C
from cachefs.errors import (
    Busy,
    Exists,
    InvalidArgument,
    NoSpace,
    NotADirectory,
    NotFound,
    NotPermitted,
    NotSupported,
)
from cachefs.ids import is_repo_slice

from .namespace import (
    _S_IFDIR,
    _S_IFREG,
    INO_MASK,
    LINK_MAX,
    MAX_INO,
    Dir,
    Inode,
    _all_records,
    _kind,
)

if TYPE_CHECKING:
    from .namespace import MetaState, Volume


def _check_outside_links(state: MetaState, vol: Volume, dir_ino: int, what: str, op: str = "tree clone") -> None:
    """Refuse a directory inside (or at) a directory linked to S3."""
    linked = {link.ino: link.id for link in state.links.values() if link.volume == vol.name}
    if not linked:
        return
    for inode in state._ancestors(vol, dir_ino):
        if inode.ino in linked:
            raise NotSupported(f"{what} is inside a directory linked to S3 (link {linked[inode.ino]}): "
                               f"{op} does not handle imported files")  # fmt: skip


def _check_cloneable(src: Inode, name: bytes) -> None:
    if _kind(src.mode) == _S_IFREG and any(is_repo_slice(rec[1]) for rec in _all_records(src.data)):
        raise NotSupported(f"{name!r} is a file imported from S3: tree clone does not copy imported files")


def _cost(src: Inode) -> tuple[int, int]:
    """What a copy of ``src`` adds to its directory's usage (a directory: empty at first)."""
    return (src.stored, 1) if _kind(src.mode) == _S_IFREG else (0, 1)


def _check_room(state: MetaState, vol: Volume, dst: Inode, sources: list[tuple[bytes, Inode]]) -> None:
    """Everything a copy of ``sources`` into ``dst`` needs, checked before any write."""
    entries = dst.data.entries
    for name, _src in sources:
        if name in entries:
            raise Exists(f"{name!r} exists in directory {dst.ino}")
    if vol.next_ino + len(sources) > MAX_INO + 1:
        raise NoSpace(f"volume {vol.name!r} ran out of inode numbers")
    dirs = sum(src.is_dir for _name, src in sources)
    if dirs and dst.nlink + dirs > LINK_MAX:
        raise NotPermitted(f"directory {dst.ino} would have too many subdirectories")
    nbytes = sum(_cost(src)[0] for _name, src in sources)
    state._check_quota(vol, dst.ino, nbytes, len(sources))
    state._check_space(vol, nbytes)


def _copy(state: MetaState, vol: Volume, dst: Inode, name: bytes, src: Inode, now: int) -> Inode:
    """Link a copy of ``src`` as ``dst/name``; the caller checked :func:`_check_room`."""
    kind = _kind(src.mode)
    if kind == _S_IFDIR:
        data: Any = Dir()
    elif kind == _S_IFREG and isinstance(src.data, dict):
        data = dict(src.data)  # chunk -> packed records: the bytes are immutable, the dict is not
    else:
        data = src.data  # records as bytes, a symlink's target, a device number: immutable
    copy = Inode(state._alloc_ino(vol), src.mode, src.uid, src.gid, now, data)
    copy.size = src.size
    copy.atime, copy.mtime = src.atime, src.mtime
    copy.xattrs = dict(src.xattrs) if src.xattrs else None
    if kind == _S_IFDIR:
        copy.nlink = 2
    elif kind == _S_IFREG:
        copy.stored, copy.blocks = src.stored, src.blocks
        vol.used_bytes += src.stored
        state.share(vol, data)
    vol.inodes[copy.ino] = copy
    state._add_entry(vol, dst, name, copy)
    return copy


def clone_entry(state: MetaState, cmd: C.CloneEntry) -> dict[str, Any]:
    vol = state._vol(cmd.volume)
    parent = state._dir(vol, cmd.src_parent)
    dst = state._dir(vol, cmd.new_parent)
    ino = state._lookup_ino(parent.data, cmd.src_name)
    if ino is None:
        raise NotFound(f"no {cmd.src_name!r} in directory {cmd.src_parent}")
    src = vol.inodes[ino]
    _check_outside_links(state, vol, src.ino if src.is_dir else parent.ino, "the source")
    _check_outside_links(state, vol, dst.ino, "the destination")
    _check_cloneable(src, cmd.src_name)
    if src.is_dir and state._is_ancestor(vol, src.ino, dst.ino):
        raise InvalidArgument("cannot clone a directory into its own subtree")
    _check_room(state, vol, dst, [(cmd.new_name, src)])
    copy = _copy(state, vol, dst, cmd.new_name, src, cmd.now_ns)
    state._touch(dst, cmd.now_ns)
    return {"ino": copy.ino, "is_dir": copy.is_dir, "bytes": copy.stored}


def clone_dir(state: MetaState, cmd: C.CloneDir) -> dict[str, Any]:
    vol = state._vol(cmd.volume)
    src_dir = state._dir(vol, cmd.src)
    dst = state._dir(vol, cmd.new_parent)
    if state._is_ancestor(vol, src_dir.ino, dst.ino):
        raise InvalidArgument("cannot clone a directory into its own subtree")
    _check_outside_links(state, vol, dst.ino, "the destination")
    _check_outside_links(state, vol, src_dir.ino, "the source")
    page = state.readdir(cmd.volume, src_dir.ino, cmd.cookie, cmd.limit)
    sources = [(entry.name, vol.inodes[entry.attr.ino]) for entry in page]
    for name, src in sources:
        _check_cloneable(src, name)
    _check_room(state, vol, dst, sources)
    # all checks done: from here on nothing fails
    dirs: list[list[int]] = []
    nbytes = 0
    for name, src in sources:
        copy = _copy(state, vol, dst, name, src, cmd.now_ns)
        nbytes += copy.stored
        if copy.is_dir:
            dirs.append([src.ino, copy.ino])
    if sources:
        state._touch(dst, cmd.now_ns)
    more = len(page) == cmd.limit
    return {"cookie": page[-1].cookie if more else 0, "entries": len(sources), "bytes": nbytes, "dirs": dirs}


# -- tree delete -------------------------------------------------------------------

Removal = tuple[Inode | None, bytes, Inode]  # (directory, name, inode it names); None: the tree's root


def delete_tree(state: MetaState, cmd: C.DeleteTree) -> dict[str, Any]:
    vol = state._vol(cmd.volume)
    parent = state._dir(vol, cmd.parent)
    ino = state._lookup_ino(parent.data, cmd.name)
    if ino is None:
        raise NotFound(f"no {cmd.name!r} in directory {cmd.parent}")
    tree = vol.inodes[ino]
    if not tree.is_dir:
        raise NotADirectory(f"{cmd.name!r} is not a directory (tree delete takes a directory; unlink a file)")
    _check_outside_links(state, vol, tree.ino, "the directory", "tree delete")
    inside = sorted(link.id for link in state.links.values()
                    if link.volume == vol.name and state._is_ancestor(vol, tree.ino, link.ino))  # fmt: skip
    if inside:
        raise Busy(f"{cmd.name!r} holds directories linked to S3 (links {inside}): unlink them first")
    state._remove_entry(vol, parent, cmd.name, tree)
    state._touch(parent, cmd.now_ns)
    total = tree.data.uinodes + 1
    vol.doomed[tree.ino] = (cmd.now_ns, total)
    return {"ino": tree.ino, "inodes": total}


def purge_batch(vol: Volume, root: int, limit: int) -> list[Removal]:
    """The next ``limit`` removals of tree ``root``, deepest first: every
    directory after everything in it, each directory's entries from its last
    (so that removing them is ``dict.popitem``, which keeps a dict that lost a
    million entries cheap to walk; ``del`` from the front would leave every
    later walk stepping over the holes). O(limit + depth)."""
    inodes = vol.inodes
    top = inodes[root]
    out: list[Removal] = []
    # (directory, its name in its parent, entries still to look at, last first)
    stack: list[tuple[Inode, bytes, Any]] = [(top, b"", reversed(top.data.entries.items()))]
    while stack:
        d, d_name, entries = stack[-1]
        for name, packed in entries:
            child = inodes[packed & INO_MASK]
            if child.is_dir and child.data.entries:
                stack.append((child, name, reversed(child.data.entries.items())))
                break
            out.append((d, name, child))
            if len(out) == limit:
                return out
        else:
            stack.pop()
            out.append((stack[-1][0] if stack else None, d_name, d))
            if len(out) == limit:
                return out
    return out


def purge_tree(state: MetaState, cmd: C.PurgeTree) -> int:
    vol = state._vol(cmd.volume)
    if cmd.root not in vol.doomed:
        raise NotFound(f"no tree {cmd.root} is being deleted in volume {cmd.volume!r}")
    free = set(cmd.free)
    removed = 0
    for d, name, child in purge_batch(vol, cmd.root, cmd.limit):
        removed += 1
        if d is None:  # the root, empty now
            del vol.doomed[child.ino]
            del vol.inodes[child.ino]
            continue
        state._remove_entry(vol, d, name, child, last=next(reversed(d.data.entries)) == name)  # always last
        if child.is_dir:
            child.nlink = 0
            del vol.inodes[child.ino]
        else:
            state._drop_link(vol, child, cmd.now_ns, keep=child.ino not in free)
    return removed
