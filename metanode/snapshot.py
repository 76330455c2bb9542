"""The namespace snapshot: all of :class:`~.namespace.MetaState` as one blob.

The format is msgpack, then zstd: ``[version, applied_index, next_slice,
cluster map, volumes, sessions, dedup answers, dedup sweep time, slice floor,
data repositories]``. It is
deterministic (the same state gives the same bytes on every replica), and
built for speed, since it runs at a Raft Ready boundary (in a forked child
by default, see ``raft/snapshot_child.py``): inodes are one flat list of
``_NFIELDS`` values each rather than a list per inode. Version 3 (open
counts per volume) still loads; version 4 keeps the orphan list instead;
version 5 counts usage (``used_bytes``, directories' ``ubytes``) in stored
bytes, which loading a 3 or 4 recounts; version 6 adds the data repository
links and imported objects (none before). ``Inode.stored`` and ``Inode.blocks`` are not
in the blob: loading counts them from the slice records.
Fields added since (a volume's token hash, repair queue, shared
slices and trees being deleted, the slice floor, the jobs table, whether a
session takes leases) are optional at the end of their list, so older
snapshots load.
"""

from __future__ import annotations

import operator
from typing import Any

import msgpack
import zstandard

from cachefs.errors import InvalidArgument

from .clustermap import ClusterMap
from .jobs import JobTable
from .namespace import (
    _S_IFDIR,
    _S_IFMT,
    _S_IFREG,
    Dir,
    Failure,
    Inode,
    MetaState,
    RepoLink,
    Session,
    Volume,
    stored_counts,
)

_SLOTS = Inode.__slots__[: Inode.__slots__.index("data") + 1]  # not ``stored``, ``blocks``
_FIELDS = operator.attrgetter(*_SLOTS)
_NFIELDS = len(_SLOTS)
VERSION = 6


def dump(state: MetaState) -> bytes:
    """The whole replicated state, msgpack then zstd; deterministic bytes."""
    volumes = [volume_row(vol) for vol in state.volumes.values()]
    sessions = [[sid, s.client_id, s.volume, [], s.leases] for sid, s in state.sessions.items()]
    dedup = []
    for client, seen in state.dedup.items():
        answers = []
        for seq, result in seen.items():
            if isinstance(result, Failure):
                answers.append([seq, 1, [result.code, result.message]])
            else:
                answers.append([seq, 0, result])
        dedup.append(
            [client, state.dedup_floor.get(client, 0), state.dedup_last.get(client, 0), answers]
        )
    parts = [
        VERSION,
        state.applied_index,
        state.next_slice,
        state.cluster.dump(),
        volumes,
        sessions,
        dedup,
        state.dedup_swept_ns,
        state.slice_floor,
        [
            [link.dump() for link in state.links.values()],
            state.next_link,
            state.next_repo,
            [v for sid, raw in state.repo_objects.items() for v in (sid, raw)],
        ],
        state.jobs.dump(),
    ]
    raw = msgpack.packb(parts, use_bin_type=True)
    return zstandard.ZstdCompressor(level=3).compress(raw)


def load(state: MetaState, data: bytes) -> None:
    """Replace ``state`` with the one ``data`` (from :func:`dump`) holds."""
    raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 40)
    parts = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    version, applied, next_slice, cluster, volumes, sessions, dedup, swept, *tail = parts
    if version not in (3, 4, 5, VERSION):
        raise InvalidArgument(f"unknown snapshot version {version}")
    state.applied_index = applied
    state.next_slice = next_slice
    state.slice_floor = tail[0] if tail else 0  # older snapshots: no floor
    links, state.next_link, state.next_repo, objects = tail[1] if len(tail) > 1 else ([], 1, 1, [])
    state.links = {d["id"]: RepoLink.from_dict(d) for d in links}
    state.repo_objects = dict(zip(objects[::2], objects[1::2], strict=True))
    state.jobs = JobTable.load(tail[2]) if len(tail) > 2 else JobTable()  # older snapshots: no jobs
    state.cluster = ClusterMap.load(cluster)
    state.volumes = {}
    for row in volumes:
        vol = load_volume(row, version)
        state.volumes[vol.name] = vol
    state.sessions = {}
    state.session_counts = {}
    for sid, client_id, volume, _files, *leases in sessions:  # older snapshots: no lease flag
        state.add_session(sid, Session(client_id, volume, bool(leases[0]) if leases else True))
    state.dedup = {}
    state.dedup_floor = {}
    state.dedup_last = {}
    state.dedup_swept_ns = swept
    for client, floor, last, answers in dedup:
        state.dedup_last[client] = last
        state.dedup[client] = {
            seq: Failure(*value) if failed else value for seq, failed, value in answers
        }
        if floor:
            state.dedup_floor[client] = floor
    state.index_lazy()


def volume_row(vol: Volume) -> list[Any]:
    """One volume as the snapshot (and a backup, see ``backup.py``) keeps it."""
    # one flat list, _NFIELDS values per inode: far cheaper to build and
    # pack than a list per inode (this runs with the Raft loop waiting)
    inodes: list[Any] = []
    extend = inodes.extend
    for i in vol.inodes.values():
        fields = _FIELDS(i)
        if fields[1] & _S_IFMT == _S_IFDIR:
            d: Dir = i.data
            flat: list[Any] = []
            for name, packed in d.entries.items():
                flat.append(name)
                flat.append(packed)
            fields = (
                *fields[:12],
                [flat, d.next_cookie, d.ubytes, d.uinodes, d.qbytes, d.qinodes],
            )
        extend(fields)
    return [
        vol.name,
        vol.next_ino,
        vol.used_bytes,
        bytes(vol.trash),
        sorted(vol.orphans),
        vol.created_ns,
        inodes,
        vol.token_hash,
        [v for (slice_id, index), t in vol.repairs.items() for v in (slice_id, index, t)],
        vol.deleted_ns,
        [v for slice_id, extra in sorted(vol.shared.items()) for v in (slice_id, extra)],
        [v for ino, (since, total) in vol.doomed.items() for v in (ino, since, total)],
    ]


def load_volume(row: list[Any], version: int = VERSION) -> Volume:
    """The :class:`Volume` a :func:`volume_row` (of snapshot ``version``) holds."""
    name, next_ino, used_bytes, trash, _opens, created_ns, inodes, *later = row
    vol = Volume(name, created_ns)
    vol.token_hash = later[0] if later else ""  # older snapshots: open
    flat = later[1] if len(later) > 1 else []  # older snapshots: no repair queue
    vol.repairs = {(flat[k], flat[k + 1]): flat[k + 2] for k in range(0, len(flat), 3)}
    vol.deleted_ns = later[2] if len(later) > 2 else 0  # older snapshots: no tombstones
    shared = later[3] if len(later) > 3 else []  # older snapshots: no clones
    vol.shared = dict(zip(shared[::2], shared[1::2], strict=True))
    doomed = later[4] if len(later) > 4 else []  # older snapshots: no tree deletes
    vol.doomed = {doomed[k]: (doomed[k + 1], doomed[k + 2]) for k in range(0, len(doomed), 3)}
    vol.inodes.clear()
    vol.next_ino = next_ino
    vol.used_bytes = used_bytes
    vol.trash = bytearray(trash)
    for k in range(0, len(inodes), _NFIELDS):
        (
            ino,
            mode,
            uid,
            gid,
            nlink,
            size,
            atime,
            mtime,
            ctime,
            iversion,
            parent,
            xattrs,
            payload,
        ) = inodes[k : k + _NFIELDS]
        if mode & _S_IFMT == _S_IFDIR:
            pairs, next_cookie, ubytes, uinodes, qbytes, qinodes = payload
            directory = Dir()
            directory.entries = dict(zip(pairs[::2], pairs[1::2], strict=True))
            directory.next_cookie = next_cookie
            directory.ubytes, directory.uinodes = ubytes, uinodes
            directory.qbytes, directory.qinodes = qbytes, qinodes
            payload = directory
        inode = Inode(ino, mode, uid, gid, ctime, payload)
        inode.nlink = nlink
        inode.size = size
        # share one int object between equal stamps, as a fresh inode does
        inode.mtime = ctime if mtime == ctime else mtime
        inode.atime = inode.mtime if atime == mtime else atime
        inode.version = iversion
        inode.parent = parent  # int, or {dir: links} (msgpack keeps dict order)
        inode.xattrs = xattrs
        inode.stored, inode.blocks = stored_counts(inode)
        vol.inodes[ino] = inode
        if nlink == 0 and mode & _S_IFMT == _S_IFREG:
            vol.orphans.add(ino)  # version 3 kept open counts; 4 the list
    if version < 5:
        _recount_usage(vol)
    return vol


def _recount_usage(vol: Volume) -> None:
    """Usage in stored bytes, for a snapshot that counted logical sizes."""
    vol.used_bytes = sum(i.stored for i in vol.inodes.values())
    dirs = [i for i in vol.inodes.values() if i.is_dir]
    for inode in dirs:
        inode.data.ubytes = 0
    for inode in vol.inodes.values():
        if not inode.is_dir and inode.stored:
            for p in inode.parents():  # each link counts, in every ancestor
                while p:
                    parent = vol.inodes[p]
                    parent.data.ubytes += inode.stored
                    p = parent.parent if isinstance(parent.parent, int) else 0
