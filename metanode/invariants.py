"""An fsck for the in-memory namespace: recompute everything derivable, compare.

Used by the tests after every random operation sequence, and usable on a live
replica's state (read-only). Each check recomputes a fact from first
principles (walking dentries), never from the counters it is checking:

- every dentry names a live inode; every live inode except orphans and the
  root is named by exactly ``nlink`` dentries (directories: by one, with
  ``nlink == 2 + subdirectories``); the ``parent`` slot lists exactly the
  directories holding its links;
- the directory graph is a tree rooted at inode 1, and at each directory
  being deleted (no cycles, every directory reachable);
- inodes without links (orphans) are regular files listed in the volume's
  ``orphans`` (kept because the leader stamped them as maybe open), and every
  listed orphan is such an inode;
- per-directory subtree usage and the volume's byte count match a recount;
- readdir cookies are unique, increasing in dict order and below
  ``next_cookie``; slice records lie inside their chunk and inside the file;
- a slice held by several records (tree clone) is counted in ``shared``
  exactly that many times less one, and no slice in the trash is held.
"""

from __future__ import annotations

import struct
from collections import Counter

from cachefs.errors import NotFound
from cachefs.ids import CHUNK_SIZE, is_repo_slice
from cachefs.layout import HOLE

from .namespace import (
    INO_BITS,
    INO_MASK,
    ROOT,
    Dir,
    MetaState,
    Volume,
    _all_records,
    _kind,
    stored_counts,
    unpack_repo_object,
)

_S_IFDIR = 0o040000
_S_IFREG = 0o100000


class InvariantError(AssertionError):
    """The namespace contradicts itself; the message lists every problem found."""


def check(state: MetaState) -> None:
    """Raise :class:`InvariantError` listing every inconsistency in ``state``."""
    problems: list[str] = []
    for vol in state.volumes.values():
        problems.extend(_check_volume(state, vol))
    if state.volumes.keys() != state.cluster.volumes.keys():
        problems.append("namespace volumes and cluster-map volumes differ")
    counts: Counter[tuple[str, str]] = Counter()
    for sid, session in state.sessions.items():
        if session.volume not in state.volumes:
            problems.append(f"session {sid} is on missing volume {session.volume}")
        counts[(session.owner, session.volume)] += 1
    if counts != state.session_counts:
        problems.append(f"session counts {state.session_counts} do not match the sessions ({dict(counts)})")
    if problems:
        raise InvariantError("\n".join(problems))


def volume_problems(state: MetaState, volume: str) -> list[str]:
    """Every inconsistency of one volume (``cachefs fsck``; raises NotFound for no such volume)."""
    vol = state.volumes.get(volume)
    if vol is None:
        raise NotFound(f"no volume {volume!r}")
    return _check_volume(state, vol)


def _check_volume(state: MetaState, vol: Volume) -> list[str]:
    p: list[str] = []
    name = vol.name
    inodes = vol.inodes
    root = inodes.get(ROOT)
    if root is None or _kind(root.mode) != _S_IFDIR:
        return [f"{name}: root is missing or not a directory"]
    links: Counter[int] = Counter()
    link_parents: dict[int, Counter[int]] = {}
    for ino, inode in inodes.items():
        if inode.ino != ino:
            p.append(f"{name}: inode {ino} is stored under the wrong number")
        if ino >= vol.next_ino:
            p.append(f"{name}: inode {ino} is not below next_ino {vol.next_ino}")
        if not inode.is_dir:
            continue
        d: Dir = inode.data
        last = 0
        subdirs = 0
        for entry, packed in d.entries.items():
            cookie, child_ino = packed >> INO_BITS, packed & INO_MASK
            if not last < cookie < d.next_cookie:
                p.append(f"{name}: dir {ino} entry {entry!r} cookie {cookie} out of order")
            last = cookie
            child = inodes.get(child_ino)
            if child is None:
                p.append(f"{name}: dir {ino} entry {entry!r} names missing inode {child_ino}")
                continue
            links[child_ino] += 1
            link_parents.setdefault(child_ino, Counter())[ino] += 1
            if child.is_dir:
                subdirs += 1
        if inode.nlink != 2 + subdirs:
            p.append(f"{name}: dir {ino} nlink {inode.nlink}, expected {2 + subdirs}")
    total_bytes = 0
    holders: Counter[int] = Counter()  # slice -> records holding it, in every file
    for ino, inode in inodes.items():
        n = links[ino]
        total_bytes += inode.stored
        recount = stored_counts(inode)
        if (inode.stored, inode.blocks) != recount:
            p.append(f"{name}: inode {ino} stored {inode.stored} bytes in {inode.blocks} blocks, recount {recount}")
        if ino == ROOT:
            if n:
                p.append(f"{name}: the root is linked from a directory")
            continue
        if inode.is_dir:
            if n != (0 if ino in vol.doomed else 1):
                p.append(f"{name}: dir {ino} has {n} links")
        elif inode.nlink != n:
            p.append(f"{name}: inode {ino} nlink {inode.nlink} but {n} dentries")
        orphan_ok = _kind(inode.mode) == _S_IFREG and ino in vol.orphans
        if n == 0 and not inode.is_dir and not orphan_ok:
            p.append(f"{name}: inode {ino} has no links and is not a kept orphan")
        expected = link_parents.get(ino, Counter())
        actual = Counter(inode.parents())
        if expected != actual:
            p.append(f"{name}: inode {ino} parent slot {dict(actual)} != dentries {dict(expected)}")
        if _kind(inode.mode) == _S_IFREG:
            for chunk, slice_id, pos, length, offset, ssize in _all_records(inode.data):
                sized = offset == ssize == 0 if slice_id == HOLE else offset + length <= ssize
                if is_repo_slice(slice_id):  # an imported object: its size is the object's
                    raw = state.repo_objects.get(slice_id)
                    if raw is None:
                        p.append(f"{name}: inode {ino} uses unknown repo slice {slice_id:x}")
                    elif ssize or offset + length > unpack_repo_object(raw)[1]:
                        p.append(f"{name}: inode {ino} bad repo slice record {slice_id:x}")
                elif not (length > 0 and pos + length <= CHUNK_SIZE and sized):
                    p.append(f"{name}: inode {ino} bad slice record {slice_id}")
                elif slice_id >= state.next_slice:
                    p.append(f"{name}: inode {ino} uses unallocated slice {slice_id}")
                if chunk * CHUNK_SIZE + pos + length > inode.size:
                    p.append(f"{name}: inode {ino} slice {slice_id} lies past the size")
                if slice_id != HOLE and not is_repo_slice(slice_id):
                    holders[slice_id] += 1
    if total_bytes != vol.used_bytes:
        p.append(f"{name}: used_bytes {vol.used_bytes}, recount {total_bytes}")
    p.extend(_check_tree(vol))
    for ino in vol.orphans:
        if ino not in inodes or inodes[ino].nlink:
            p.append(f"{name}: orphan {ino} is gone or still linked")
    if len(vol.trash) % struct.calcsize("<QIQ"):
        p.append(f"{name}: trash is not whole records")
    shared = {sid: n - 1 for sid, n in holders.items() if n > 1}
    if shared != vol.shared:
        wrong = sorted(set(shared.items()) ^ set(vol.shared.items()))[:10]
        p.append(f"{name}: shared slice counts differ from a recount of the records (slice, extra): {wrong}")
    held_trash = sorted({rec[0] for rec in struct.iter_unpack("<QIQ", vol.trash)} & holders.keys())
    if held_trash:
        p.append(f"{name}: slices in the trash are still held by files: {held_trash[:10]}")
    if vol.repairs:  # a queued block's slice is in some file, or in the trash until its blocks go
        known = {rec[0] for rec in struct.iter_unpack("<QIQ", vol.trash)}
        for inode in inodes.values():
            if _kind(inode.mode) == _S_IFREG:
                known.update(rec[1] for rec in _all_records(inode.data))
        for slice_id, index in vol.repairs:
            if slice_id not in known:
                p.append(f"{name}: repair queued for block {index} of slice {slice_id}, which nothing holds")
    return p


def _check_tree(vol: Volume) -> list[str]:
    """Reachability, acyclicity and subtree usage, recomputed bottom-up."""
    p: list[str] = []
    inodes = vol.inodes
    seen: set[int] = set()
    order: list[int] = []  # directories, parents before children
    for ino in vol.doomed:
        if ino not in inodes or not inodes[ino].is_dir:
            p.append(f"{vol.name}: tree {ino} being deleted is gone or not a directory")
    stack = [ROOT, *(i for i in vol.doomed if i in inodes and inodes[i].is_dir)]  # each a root of its own
    while stack:
        ino = stack.pop()
        if ino in seen:
            p.append(f"{vol.name}: directory {ino} reached twice (cycle)")
            continue
        seen.add(ino)
        order.append(ino)
        for packed in inodes[ino].data.entries.values():
            child = inodes.get(packed & INO_MASK)
            if child is not None and child.is_dir:
                stack.append(child.ino)
    usage: dict[int, tuple[int, int]] = {}
    for ino in reversed(order):  # children first
        d: Dir = inodes[ino].data
        nbytes = ninodes = 0
        for packed in d.entries.values():
            child = inodes.get(packed & INO_MASK)
            if child is None:
                continue
            if child.is_dir:
                b, i = usage.get(child.ino, (0, 0))
                nbytes += b
                ninodes += i + 1
            else:
                nbytes += child.stored
                ninodes += 1
        usage[ino] = (nbytes, ninodes)
        if (d.ubytes, d.uinodes) != (nbytes, ninodes):
            p.append(
                f"{vol.name}: dir {ino} usage ({d.ubytes}, {d.uinodes}), recount ({nbytes}, {ninodes})"
            )
    for ino, inode in inodes.items():
        if inode.is_dir and ino not in seen:
            p.append(f"{vol.name}: directory {ino} is unreachable")
    return p
