"""The metanode state machine: volumes, namespace, slices, sessions, cluster map.

Theory of operation
-------------------
``MetaState`` is a pure, deterministic state machine (the Raft state machine
protocol: ``apply(index, command) -> result``, ``snapshot()``, ``restore()``).
Mutations arrive as encoded :mod:`cachefs.commands`; reads (``lookup``, ``getattr``,
``readdir``, ``read_chunk``...) are plain methods that :mod:`cachefs.queries` run on
the leader. Results are the typed replies of :mod:`cachefs.messages`
(named tuples, so msgpack sends them, and keeps them in the dedup table
of the snapshot, as arrays). ``apply`` never raises: a refused mutation returns a
:class:`Failure` carrying the errno-like code, and it changes nothing, because
every operation checks all its preconditions before its first write.

Client sessions: a command with a ``client_id`` and a ``seq`` above 0 is
answered once; a repeat of
the same ``(client_id, seq)`` gets the stored first answer (success or
failure). The last ``DEDUP_WINDOW`` answers per client are kept, in the
snapshot too; a seq older than the window is refused rather than re-applied.
A client silent for ten minutes (by the leaders' clocks in the log) is
forgotten, so departed clients do not accumulate.

Memory (the state is all in RAM, so it is kept compact, as JuiceFS/CubeFS do):

- ``Inode`` has ``__slots__``; the three timestamps share one int object when
  equal; the type-specific part lives in one ``data`` slot: a :class:`Dir`
  for directories, the packed slice records for regular files, the target for
  symlinks, ``rdev`` for devices.
- A file's slices are 28-byte packed records ``(chunk, slice_id, pos, length,
  offset, slice_size)`` in one ``bytes`` object, sorted by chunk and in commit
  order inside a chunk (newest last, newest wins on read). A file with many
  records switches to a ``dict[chunk, bytes]``.
- A directory maps ``name -> (cookie << 40) | ino`` in one dict: the cookie
  is a per-directory counter assigned when the name is added, and dicts keep
  insertion order, so dict order is cookie order. ``readdir(cookie)`` resumes
  after that cookie, stable while other entries come and go (an entry that
  exists for the whole listing is returned exactly once). Replacing a name
  keeps its cookie.

Directory usage: every directory keeps the bytes and inode count of its
subtree (``du`` in one call). Each dentry counts: a hard link counts once in
every directory that names it, so a quota cannot be dodged by linking a file
out of its scope and unlinking the original (the Backend.AI "quota scope").
Bytes are what is stored, not logical sizes: a file counts the sizes of
the slices its records hold (``Inode.stored``; a hole record and a sparse
tail hold none), so a sparse file costs only what was written, and
shrinking a file or punching a hole never needs space. A quota on a
directory is checked against the growth of its subtree before any change
(EDQUOT). The datanodes' capacity (ENOSPC, ``statfs``) counts the same bytes
times each volume's storage overhead (``ec:4+2`` stores 1.5 bytes per byte,
``replica:3`` three).
``Inode.blocks`` counts the same records for ``st_blocks``, each in 4 KiB
blocks rounded up (as ext4 allocates a write), so ``du`` and ``cp --sparse``
see what is stored without a walk of the records at getattr; an imported
object's records count the range they read from its bucket.

Unlinked but open: which files are open is soft state on the leader
(``opentable.OpenTable``), not replicated: open and release add no log entry.
Instead the leader stamps into every command that can drop a file's last
link (``Unlink``, ``Rename`` over a target) the inode it expects to drop
(``expect``) and whether to keep it (``keep``). The apply keeps the inode as an
orphan (nlink 0, no parent, listed in ``Volume.orphans``) when the stamp says
so, or when the dropped inode is not the expected one (the stamp cannot speak
for it: keep, conservatively); otherwise its slices go to the trash at once.
So every replica decides the same. Orphans are freed by ``PurgeOrphans``,
which the leader proposes when the last open goes or the holder's session
ends.

Repair queue: blocks a writer stored with fewer than all their shards
(``WriteSlice.short``, ``CompactChunk.short``) are listed in
``Volume.repairs`` by the same log entry that commits their slice, oldest
first, until the leader's repair service reports them whole
(``RepairsDone``) or their slice leaves the trash (``PurgeTrash``: its
blocks are gone).

Shared slices: a tree clone (``metanode/trees.py``) copies files' slice
records, so one slice may be held by records of several files; blocks are
immutable, so writes to either copy make new slices and never change the
other. ``Volume.shared`` counts, per such slice, its records beyond the
first; every removal of a record goes through ``_trash``, which lowers that
count and trashes the slice only when its last record goes. So the trash (and
the collector, which deletes only trashed slices' blocks) never holds a
slice a file still reads.

Slice floor: ``SealSlices`` raises ``slice_floor``, below which no slice
may be committed any more (``SliceExpired``), so a slice below it that
nothing references now never will be, and the collector may delete its
blocks (``unreferenced``; the argument is in ``cachefs/backing/gc.py``).

Permissions are checked by the kernel (the FUSE mount uses
``default_permissions``), as in JuiceFS's and CubeFS's FUSE clients; the
metanode enforces structure: types, names, emptiness, links, cycles, quotas.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import hmac
import itertools
import stat
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from cachefs import commands as C
from cachefs.backing.policy import VolumePolicy
from cachefs.errors import (
    Busy,
    CacheFSError,
    CrossDevice,
    Exists,
    InvalidArgument,
    IsADirectory,
    NoData,
    NoSpace,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    PermissionDenied,
    QuotaExceeded,
    SliceExpired,
    Stale,
    error_from_wire,
)
from cachefs.ids import CHUNK_SIZE, REPO_SLICE_BIT, is_repo_slice
from cachefs.layout import HOLE
from cachefs.messages import (
    Attr,
    DirEntry,
    FsStats,
    LoadedEntry,
    MountInfo,
    Renamed,
    RepairEntry,
    TrashEntry,
    Unreferenced,
    Usage,
)

from . import exports
from .clustermap import ClusterMap, VolumeSpec
from .jobs import JobTable

ROOT = 1
INO_BITS = 40
INO_MASK = (1 << INO_BITS) - 1
MAX_INO = INO_MASK
DEDUP_WINDOW = 1024
DEDUP_SWEEP_NS = 60 * 10**9
DEDUP_IDLE_NS = 600 * 10**9
FLAT_MAX_RECORDS = 64
INDEX_MIN_ENTRIES = 64
LINK_MAX = 65000
DIR_SIZE = 4096

_REC = struct.Struct("<IQIIII")  # chunk, slice_id, pos, length, offset, slice_size
_TRASH = struct.Struct("<QIQ")  # slice_id, slice_size, deleted_ns

_S_IFMT = 0o170000
_S_IFDIR = stat.S_IFDIR
_S_IFREG = stat.S_IFREG
_S_IFLNK = stat.S_IFLNK


class ApplyWatcher(Protocol):
    """Told which inodes each apply touched, in the volumes it asks about
    (the leader's leases, ``metanode/leases.py``; never part of the state)."""

    def watching(self, volume: str) -> bool: ...

    def applied(self, volume: str, inos: Iterable[int], named: Iterable[int] | None = None) -> None: ...


@dataclass(frozen=True, slots=True)
class Failure:
    """A refused mutation: the result ``apply`` returns instead of raising."""

    code: str
    message: str

    def error(self) -> CacheFSError:
        err = error_from_wire(self.code, self.message)
        err.remote = False
        return err


class Dir:
    __slots__ = ("entries", "next_cookie", "ubytes", "uinodes", "qbytes", "qinodes", "index")

    def __init__(self) -> None:
        self.entries: dict[bytes, int] = {}
        self.next_cookie = 1
        self.ubytes = 0
        self.uinodes = 0
        self.qbytes: int | None = None
        self.qinodes: int | None = None
        # (cookies, names) in order, built lazily for paging big directories;
        # None whenever entries changed since
        self.index: tuple[list[int], list[bytes]] | None = None


class Inode:
    __slots__ = (
        "ino",
        "mode",
        "uid",
        "gid",
        "nlink",
        "size",
        "atime",
        "mtime",
        "ctime",
        "version",
        "parent",
        "xattrs",
        "data",
        "stored",
        "blocks",
    )

    def __init__(self, ino: int, mode: int, uid: int, gid: int, now: int, data: Any) -> None:
        self.ino = ino
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.nlink = 1
        self.size = 0
        self.atime = self.mtime = self.ctime = now
        self.version = 1
        # the directory holding the (only) link; {dir: links} for hard links;
        # 0 for the root and for orphans
        self.parent: int | dict[int, int] = 0
        self.xattrs: dict[bytes, bytes] | None = None
        self.data = data
        self.stored = 0  # bytes of the slices its records hold (regular files)
        self.blocks = 0  # the same records in 4 KiB blocks, each rounded up (st_blocks / 8)

    @property
    def is_dir(self) -> bool:
        return self.mode & _S_IFMT == _S_IFDIR

    def parents(self) -> Iterator[int]:
        """Every directory holding a link, once per link."""
        if isinstance(self.parent, dict):
            for p, n in self.parent.items():
                for _ in range(n):
                    yield p
        elif self.parent:
            yield self.parent


# Attr's fields are written in order below: skip NamedTuple's keyword-taking
# __new__ (getattr answers are the hottest path).
_new_attr = tuple.__new__


def hash_token(token: str) -> str:
    """What a volume keeps of its mount token (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


class Volume:
    __slots__ = (
        "name",
        "inodes",
        "next_ino",
        "used_bytes",
        "trash",
        "orphans",
        "created_ns",
        "token_hash",
        "repairs",
        "deleted_ns",
        "shared",
        "doomed",
    )

    def __init__(self, name: str, now: int) -> None:
        self.name = name
        self.inodes: dict[int, Inode] = {}
        self.next_ino = ROOT + 1
        self.used_bytes = 0
        self.trash = bytearray()
        self.orphans: set[int] = set()  # unlinked regular files kept: maybe open
        self.created_ns = now
        self.token_hash = ""  # sha256 hex of the mount token; "" = open volume
        self.repairs: dict[tuple[int, int], int] = {}  # (slice_id, block) stored short -> when queued
        self.deleted_ns = 0  # deleted (C.DeleteVolume): a tombstone until the trash is empty
        # slice id -> records holding it beyond the first (tree clone); a slice
        # held once, the usual case, is not listed (see "Shared slices" above)
        self.shared: dict[int, int] = {}
        # directories being deleted (tree delete): out of the namespace, each
        # the root of its own tree until PurgeTree empties it -> (since_ns, inodes)
        self.doomed: dict[int, tuple[int, int]] = {}
        root = Inode(ROOT, _S_IFDIR | 0o755, 0, 0, now, Dir())
        root.nlink = 2
        self.inodes[ROOT] = root


class RepoLink:
    """A directory of a volume linked to an S3 prefix (a data repository
    association). ``pending``: the directories (prefixes relative to the
    link's) not listed to the end yet, each with the key or prefix its
    listing goes on after ("" to start), so an interrupted import resumes
    per directory; ``imported_ns``: when the last directory was listed (0
    while some are pending). ``empties``: files of empty objects (no repo
    slice says they are imported). No credentials: every reader has its own."""

    __slots__ = ("id", "volume", "ino", "bucket", "prefix", "endpoint", "region", "import_mode",
                 "objects", "created_ns", "imported_ns", "auto_import", "auto_export", "exported",
                 "export_gen", "pending", "empties", "puts", "deletes", "written")  # fmt: skip
    _SHOWN = __slots__[:15]  # as they are; the rest are summed up or internal

    def __init__(self, link_id: int, cmd: C.LinkRepo) -> None:
        self.id = link_id
        self.volume = cmd.volume
        self.ino = cmd.ino
        self.bucket = cmd.bucket
        self.prefix = cmd.prefix
        self.endpoint = cmd.endpoint
        self.region = cmd.region
        self.import_mode = cmd.import_mode
        self.objects = 0
        self.created_ns = cmd.now_ns
        self.imported_ns = 0
        self.auto_import = cmd.auto_import
        self.auto_export = cmd.auto_export
        self.exported = 0  # exports done
        self.export_gen = 0  # the last export queued (metanode/exports.py)
        self.pending: dict[str, str] = {"": ""}
        self.empties: set[int] = set()
        self.puts: dict[int, list[Any]] = {}  # the export queue: see metanode/exports.py
        self.deletes: dict[str, list[Any]] = {}
        self.written: set[int] = set()

    def to_dict(self) -> dict[str, Any]:
        """As ``ListRepoLinks`` shows it: ``pending`` is a count here, and so
        are the exports (``failed`` ones are still queued, not ``pending``)."""
        out = {name: getattr(self, name) for name in self._SHOWN}
        failed = sum(1 for rec in self.puts.values() if rec[2]) + sum(1 for rec in self.deletes.values() if rec[1])
        queued = len(self.puts) + len(self.deletes)
        exports = {"pending": queued - failed, "failed": failed, "done": self.exported}
        return {**out, "pending": len(self.pending), "url": f"s3://{self.bucket}/{self.prefix}", "exports": exports}

    def dump(self) -> dict[str, Any]:
        """Everything, for snapshots."""
        return {**self.to_dict(), "pending": self.pending, "empties": sorted(self.empties),
                "puts": [[ino, *rec] for ino, rec in self.puts.items()],
                "deletes": [[key, *rec] for key, rec in self.deletes.items()],
                "written": sorted(self.written)}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RepoLink:
        link = cls.__new__(cls)
        for name in cls._SHOWN:
            setattr(link, name, d.get(name, 0))  # auto_import: not in older snapshots
        # older snapshots kept one cursor of a flat listing: list again from the start
        pending = d.get("pending", {} if d["imported_ns"] else {"": ""})
        link.pending = dict(pending) if isinstance(pending, dict) else {}
        if not isinstance(link.auto_export, str):
            link.auto_export = ""  # older snapshots: no exports
        link.empties = set(d.get("empties", ()))
        link.puts = {row[0]: list(row[1:]) for row in d.get("puts", ())}
        link.deletes = {row[0]: list(row[1:]) for row in d.get("deletes", ())}
        link.written = set(d.get("written", ()))
        return link

    def owns(self, state: MetaState, inode: Inode) -> bool:
        """Whether ``inode`` is a file imported by this link and not written since."""
        if _kind(inode.mode) != _S_IFREG:
            return False
        seen = False
        for rec in _all_records(inode.data):  # stops at the first record not of this link
            sid, seen = rec[1], True
            raw = state.repo_objects.get(sid) if is_repo_slice(sid) else None
            if raw is None or unpack_repo_object(raw)[0] != self.id:
                return False
        return seen or (inode.size == 0 and inode.ino in self.empties)


# A repo slice's object: link id, size, ETag length, then the ETag and the key
# relative to the link's prefix, in one bytes object (kept per imported file).
_REPO_OBJ = struct.Struct("<IQH")


def pack_repo_object(link_id: int, size: int, etag: str, key: str) -> bytes:
    tag = etag.encode()
    return _REPO_OBJ.pack(link_id, size, len(tag)) + tag + key.encode()


def unpack_repo_object(raw: bytes) -> tuple[int, int, str, str]:
    """``(link_id, size, etag, key)``."""
    link_id, size, n = _REPO_OBJ.unpack_from(raw)
    start = _REPO_OBJ.size
    return link_id, size, raw[start : start + n].decode(), raw[start + n :].decode()


class Session:
    """A mounted client; which files it has open is the leader's soft state.

    ``owner``: the identity that mounted it, the tag the leader put before
    its ``client_id`` (``Identity.tag``; "" if none was, as on an insecure
    cluster). Only that identity (or a server or admin) may act on it.
    ``leases``: whether it may hold metadata leases (``MountVolume``).
    """

    __slots__ = ("client_id", "leases", "owner", "volume")

    def __init__(self, client_id: str, volume: str, leases: bool = True) -> None:
        self.client_id = client_id
        self.volume = volume
        self.leases = leases
        owner, stamped, _ = client_id.partition("/")
        self.owner = owner if stamped else ""


# -- slice records -----------------------------------------------------------------

Rec = tuple[int, int, int, int, int]  # slice_id, pos, length, offset, slice_size


def _all_records(
    data: bytes | dict[int, bytes] | None,
) -> Iterator[tuple[int, int, int, int, int, int]]:
    if data is None:
        return
    if isinstance(data, dict):
        for raw in data.values():
            yield from _REC.iter_unpack(raw)
    else:
        yield from _REC.iter_unpack(data)


def _chunk_records(data: bytes | dict[int, bytes] | None, chunk: int) -> list[Rec]:
    if data is None:
        return []
    if isinstance(data, dict):
        return [r[1:] for r in _REC.iter_unpack(data.get(chunk, b""))]
    return [r[1:] for r in _REC.iter_unpack(data) if r[0] == chunk]


def _store_chunk(
    data: bytes | dict[int, bytes] | None, chunk: int, recs: list[Rec]
) -> bytes | dict[int, bytes] | None:
    """Replace one chunk's records; returns the file's new ``data``."""
    if isinstance(data, dict):
        if recs:
            data[chunk] = b"".join(_REC.pack(chunk, *r) for r in recs)
        else:
            data.pop(chunk, None)
        return data or None
    rows = [r for r in _all_records(data) if r[0] != chunk]
    rows.extend((chunk, *r) for r in recs)
    rows.sort(key=lambda r: r[0])  # stable: commit order inside a chunk is kept
    if len(rows) > FLAT_MAX_RECORDS:
        split: dict[int, list[bytes]] = {}
        for r in rows:
            split.setdefault(r[0], []).append(_REC.pack(*r))
        return {c: b"".join(parts) for c, parts in split.items()}
    return b"".join(_REC.pack(*r) for r in rows) or None


def _kind(mode: int) -> int:
    return mode & _S_IFMT


def stored_counts(inode: Inode) -> tuple[int, int]:
    """``Inode.stored`` and ``Inode.blocks`` recounted from the records: each
    record's slice size, and its 4 KiB blocks; (0, 0) for anything but a file."""
    if _kind(inode.mode) != _S_IFREG:
        return 0, 0
    nbytes = nblocks = 0
    for rec in _all_records(inode.data):
        nbytes += rec[5]
        nblocks += _rec_blocks(rec[1], rec[3], rec[5])
    return nbytes, nblocks


def _rec_blocks(slice_id: int, length: int, slice_size: int) -> int:
    """The 4 KiB blocks a record counts in ``Inode.blocks``: its slice's; for
    an imported object's record (no bytes here) the range it reads."""
    return ((length if is_repo_slice(slice_id) else slice_size) + 4095) >> 12


def _recs_blocks(recs: Iterable[Rec]) -> int:
    return sum(_rec_blocks(r[0], r[2], r[4]) for r in recs)


@functools.cache
def storage_overhead(policy: str) -> float:
    """Bytes the datanodes hold per byte stored under ``policy``."""
    p = VolumePolicy.parse(policy)
    return p.n / p.k


class MetaState:
    """All replicated metanode state; see the module docstring."""

    def __init__(self) -> None:
        self.volumes: dict[str, Volume] = {}
        self.cluster = ClusterMap()
        self.sessions: dict[str, Session] = {}
        # (owner, volume) -> how many sessions it has there; derived from
        # ``sessions`` (never in the snapshot): what per-call token checks ask
        self.session_counts: dict[tuple[str, str], int] = {}
        self.dedup: dict[str, dict[int, Any]] = {}
        self.dedup_floor: dict[str, int] = {}
        self.dedup_last: dict[str, int] = {}  # client -> now_ns of its last command
        self.dedup_swept_ns = 0
        self.next_slice = 1
        self.slice_floor = 0  # no commit of a slice id below it (SealSlices)
        self.links: dict[int, RepoLink] = {}
        self.next_link = 1
        self.next_repo = 1  # repo slice ids are REPO_SLICE_BIT | next_repo
        self.repo_objects: dict[int, bytes] = {}  # repo slice id -> pack_repo_object
        # (volume, ino) -> (link id, path): pending directories of lazy links, which
        # the leader lists when first read; derived from the links (see index_lazy)
        self.lazy_dirs: dict[tuple[str, int], tuple[int, str]] = {}
        # volume -> {directory ino: link} of the links that export (metanode/exports.py)
        self.exporting: dict[str, dict[int, RepoLink]] = {}
        self.jobs = JobTable()  # warm-up jobs (metanode/jobs.py)
        self.applied_index = 0
        self.watcher: ApplyWatcher | None = None  # set by the leader's service
        self._handlers: dict[type[C.Command], Callable[[Any], Any]] = {
            C.CreateVolume: self._create_volume,
            C.SetVolumeCompression: self._set_volume_compression,
            C.SetVolumeAccess: self._set_volume_access,
            C.MountVolume: self._mount_volume,
            C.CloseSession: self._close_session,
            C.SetAttr: self._setattr,
            C.Mknod: self._mknod,
            C.Mkdir: self._mkdir,
            C.Symlink: self._symlink,
            C.Link: self._link,
            C.Unlink: self._unlink,
            C.Rmdir: self._rmdir,
            C.Rename: self._rename,
            C.SetXattr: self._setxattr,
            C.RemoveXattr: self._removexattr,
            C.SetQuota: self._set_quota,
            C.AllocSlices: self._alloc_slices,
            C.WriteSlice: self._write_slice,
            C.CompactChunk: self._compact_chunk,
            C.Fallocate: self._fallocate,
            C.PurgeTrash: self._purge_trash,
            C.PurgeOrphans: self._purge_orphans,
            C.RepairsDone: self._repairs_done,
            C.SealSlices: self._seal_slices,
            C.RegisterNode: self._register_node,
            C.RemoveNode: self._remove_node,
            C.DrainNode: lambda cmd: self.cluster.set_draining(cmd.node_id, cmd.drain),
            C.LinkRepo: self._link_repo,
            C.UnlinkRepo: self._unlink_repo,
            C.ImportObjects: self._import_objects,
            C.QueueExports: self._queue_exports,
            C.ExportDone: self._export_done,
            C.ReleaseFile: self._release_file,
            C.RestoreVolume: self._restore_volume,
            C.DeleteVolume: self._delete_volume,
            C.DropVolume: self._drop_volume,
            C.SubmitJob: self._submit_job,
            C.CancelJob: lambda cmd: self.jobs.cancel(cmd),
            C.JobProgress: lambda cmd: self.jobs.progress(cmd),
            C.CloneEntry: self._clone_entry,
            C.CloneDir: self._clone_dir,
            C.DeleteTree: self._delete_tree,
            C.PurgeTree: self._purge_tree,
        }

    # -- the state machine protocol ---------------------------------------------------

    def apply(self, index: int, command: bytes | C.Command) -> Any:
        """Apply one committed log entry; returns the result or a :class:`Failure`."""
        if index:
            self.applied_index = index
        try:
            cmd = command if isinstance(command, C.Command) else C.decode(command)
        except CacheFSError as err:
            return Failure(err.code, err.message)
        client = cmd.client_id if cmd.seq else ""  # seq 0: not deduplicated
        if client:
            seen = self.dedup.get(client)
            if seen is not None and cmd.seq in seen:
                return seen[cmd.seq]
            if cmd.seq < self.dedup_floor.get(client, 0):
                return Failure("EINVAL", f"seq {cmd.seq} is older than the dedup window")
        watched = self._watched(cmd)
        export = exports.before(self, cmd) if self.exporting and type(cmd) in exports.HOOKED else None
        try:
            result = self._handlers[type(cmd)](cmd)
        except CacheFSError as err:
            result = Failure(err.code, err.message)
        else:
            if export is not None:
                exports.after(self, cmd, export, result)
        if watched is not None and self.watcher is not None:
            volume, refs, before = watched
            # and what the names resolve to after it: a create's new inode
            self.watcher.applied(volume, before | self._resolve(volume, *refs), refs[0])
        if client:
            self._remember(client, cmd.seq, result)
            self.dedup_last[client] = cmd.now_ns
            if cmd.now_ns - self.dedup_swept_ns > DEDUP_SWEEP_NS:
                self._sweep_dedup(cmd.now_ns)
        return result

    def _watched(
        self, cmd: C.Command
    ) -> tuple[str, tuple[tuple[int, ...], tuple[tuple[int, bytes], ...]], set[int]] | None:
        """``(volume, refs, inodes touched)`` of ``cmd`` resolved before it
        applies, if the watcher wants to hear about its volume."""
        watcher = self.watcher
        if watcher is None:
            return None
        refs = self._refs(cmd)
        if refs is None or not watcher.watching(refs[0]):
            return None
        volume, inos, entries = refs
        return volume, (inos, entries), self._resolve(volume, inos, entries)

    def touched(self, cmd: C.Command) -> tuple[str, set[int]] | None:
        """``(volume, inodes)`` that ``cmd`` changes if it applied now (see
        ``commands.inode_refs``), or None for commands that change no inode."""
        refs = self._refs(cmd)
        if refs is None:
            return None
        return refs[0], self._resolve(*refs)

    def resolves_in(self, cmd: C.Command) -> frozenset[int] | None:
        """The directories whose entries ``cmd`` resolves when it applies
        (the parents of its ``(parent, name)`` entries), or None if it may
        resolve names anywhere in its volume: an import walks paths."""
        if type(cmd) is C.ImportObjects:
            return None
        refs = C.inode_refs(cmd)
        return frozenset() if refs is None else frozenset(parent for parent, _ in refs[2])

    def _refs(self, cmd: C.Command) -> C.Refs | None:
        """``commands.inode_refs``, and for an import (which names a link, not
        inodes) the link's directory and every inode and name its keys walk."""
        if type(cmd) is not C.ImportObjects:
            return C.inode_refs(cmd)
        link = self.links.get(cmd.link_id)
        vol = self.volumes.get(link.volume) if link is not None else None
        if vol is None or link.ino not in vol.inodes:
            return None
        inos = {link.ino}
        entries = set()
        walked = [key for key, *_ in cmd.objects()] + [sub[:-1] for sub in cmd.prefixes()]
        for key in walked:
            parent = vol.inodes[link.ino]
            for part in key.split("/"):
                name = part.encode()
                entries.add((parent.ino, name))
                ino = self._lookup_ino(parent.data, name)
                if ino is None:
                    break
                inos.add(ino)
                parent = vol.inodes[ino]
                if not parent.is_dir:
                    break
        if cmd.prune:  # what may go: every inode under the names the page speaks for
            pruned = self._pruned(vol, link, cmd, cmd.objects(), cmd.prefixes())
            todo = [(d, name, child) for d, name, child, _ in pruned]
            while todo:
                d, name, child = todo.pop()
                inos.update((d.ino, child.ino))
                entries.add((d.ino, name))
                if child.is_dir:
                    todo += [(child, n, vol.inodes[p & INO_MASK]) for n, p in child.data.entries.items()]
        return link.volume, tuple(inos), tuple(entries)

    def _resolve(
        self, volume: str, inos: tuple[int, ...], entries: tuple[tuple[int, bytes], ...]
    ) -> set[int]:
        out = set(inos)
        vol = self.volumes.get(volume)
        if vol is not None:
            for parent, name in entries:
                d = vol.inodes.get(parent)
                if d is not None and d.is_dir:
                    ino = self._lookup_ino(d.data, name)
                    if ino is not None:
                        out.add(ino)
        return out

    def _sweep_dedup(self, now: int) -> None:
        """Forget clients silent for DEDUP_IDLE_NS (leader time from the log, so
        every replica forgets the same ones at the same entry). A client's
        retries end within its deadline (30 s), far inside that horizon."""
        self.dedup_swept_ns = now
        for client in [c for c, last in self.dedup_last.items() if now - last > DEDUP_IDLE_NS]:
            del self.dedup_last[client]
            self.dedup.pop(client, None)
            self.dedup_floor.pop(client, None)

    def _remember(self, client: str, seq: int, result: Any) -> None:
        seen = self.dedup.get(client)
        if seen is None:
            seen = self.dedup[client] = {}
        seen[seq] = result
        if len(seen) > DEDUP_WINDOW:
            oldest = next(iter(seen))  # the first answered (seqs arrive nearly in order)
            del seen[oldest]
            self.dedup_floor[client] = max(self.dedup_floor.get(client, 0), oldest + 1)

    # -- helpers --------------------------------------------------------------------

    def _vol(self, name: str) -> Volume:
        vol = self.volumes.get(name)
        if vol is None:
            raise NotFound(f"no volume {name!r}")
        if vol.deleted_ns:
            raise NotFound(f"volume {name!r} is deleted (its blocks are being collected)")
        return vol

    def _gc_vol(self, name: str) -> Volume:
        """A volume for the garbage collector and repair: a deleted one too."""
        vol = self.volumes.get(name)
        if vol is None:
            raise NotFound(f"no volume {name!r}")
        return vol

    def is_deleted(self, name: str) -> bool:
        vol = self.volumes.get(name)
        return vol is not None and bool(vol.deleted_ns)

    @staticmethod
    def _inode(vol: Volume, ino: int) -> Inode:
        inode = vol.inodes.get(ino)
        if inode is None:
            raise NotFound(f"no inode {ino}")
        return inode

    def _dir(self, vol: Volume, ino: int) -> Inode:
        inode = self._inode(vol, ino)
        if not inode.is_dir:
            raise NotADirectory(f"inode {ino} is not a directory")
        if inode.nlink == 0:
            raise NotFound(f"directory {ino} was removed")
        return inode

    @staticmethod
    def _lookup_ino(d: Dir, name: bytes) -> int | None:
        packed = d.entries.get(name)
        return None if packed is None else packed & INO_MASK

    @staticmethod
    def _contrib(inode: Inode) -> tuple[int, int]:
        """What one dentry naming ``inode`` adds to its directory's usage."""
        if inode.is_dir:
            d: Dir = inode.data
            return d.ubytes, d.uinodes + 1
        return inode.stored, 1

    def _ancestors(self, vol: Volume, ino: int) -> Iterator[Inode]:
        """The directory ``ino`` and its ancestors up to the root."""
        while ino:
            inode = vol.inodes[ino]
            yield inode
            ino = inode.parent if isinstance(inode.parent, int) else 0

    def _check_quota(
        self, vol: Volume, dir_ino: int, dbytes: int, dinodes: int, stop: set[int] | None = None
    ) -> None:
        if dbytes <= 0 and dinodes <= 0:
            return
        for inode in self._ancestors(vol, dir_ino):
            if stop and inode.ino in stop:
                break
            d: Dir = inode.data
            if dbytes > 0 and d.qbytes is not None and d.ubytes + dbytes > d.qbytes:
                raise QuotaExceeded(f"byte quota {d.qbytes} of directory {inode.ino}")
            if dinodes > 0 and d.qinodes is not None and d.uinodes + dinodes > d.qinodes:
                raise QuotaExceeded(f"inode quota {d.qinodes} of directory {inode.ino}")

    def _charge(self, vol: Volume, dir_ino: int, dbytes: int, dinodes: int) -> None:
        for inode in self._ancestors(vol, dir_ino):
            d: Dir = inode.data
            d.ubytes += dbytes
            d.uinodes += dinodes

    def _overhead(self, vol: Volume) -> float:
        """Datanode bytes per byte stored in the volume (none for one in an object store)."""
        spec = self.cluster.volumes.get(vol.name)
        if spec is not None and spec.backing:
            return 0.0
        return storage_overhead(spec.policy) if spec is not None else 1.0

    def _raw_used(self) -> float:
        """Bytes the datanodes hold for every volume (stored times overhead)."""
        return sum(v.used_bytes * self._overhead(v) for v in self.volumes.values())

    def _check_space(self, vol: Volume, dbytes: int) -> None:
        if dbytes <= 0:
            return
        capacity, _ = self.cluster.capacity()
        if not capacity:
            return
        need = dbytes * self._overhead(vol)
        if not need:
            return  # its bytes go to an object store, whose space is its own
        used = self._raw_used()
        if used + need > capacity:
            raise NoSpace(
                f"storing {dbytes} more bytes needs {need:.0f} of the datanodes' {capacity}; "
                f"{used:.0f} are in use"
            )

    def _alloc_ino(self, vol: Volume) -> int:
        if vol.next_ino > MAX_INO:
            raise NoSpace(f"volume {vol.name!r} ran out of inode numbers")
        ino = vol.next_ino
        vol.next_ino += 1
        return ino

    @staticmethod
    def _add_parent(inode: Inode, p: int) -> None:
        if not inode.parent:
            inode.parent = p
        elif isinstance(inode.parent, dict):
            inode.parent[p] = inode.parent.get(p, 0) + 1
        else:
            inode.parent = {inode.parent: 1, p: 1} if inode.parent != p else {p: 2}

    @staticmethod
    def _remove_parent(inode: Inode, p: int) -> None:
        if isinstance(inode.parent, dict):
            left = inode.parent[p] - 1
            if left:
                inode.parent[p] = left
            else:
                del inode.parent[p]
            if sum(inode.parent.values()) == 1:
                (only,) = inode.parent
                inode.parent = only
            elif not inode.parent:
                inode.parent = 0
        else:
            inode.parent = 0

    def _add_entry(self, vol: Volume, parent: Inode, name: bytes, child: Inode) -> None:
        """Link ``child`` under ``name``; the caller checked the name is free."""
        d: Dir = parent.data
        d.entries[name] = (d.next_cookie << INO_BITS) | child.ino
        d.next_cookie += 1
        d.index = None
        self._add_parent(child, parent.ino)
        dbytes, dinodes = self._contrib(child)
        self._charge(vol, parent.ino, dbytes, dinodes)
        if child.is_dir:
            parent.nlink += 1

    def _remove_entry(self, vol: Volume, parent: Inode, name: bytes, child: Inode, last: bool = False) -> None:
        """``last``: ``name`` is the directory's last entry, removed with
        ``popitem``, which (unlike ``del``) leaves no hole for later walks."""
        d: Dir = parent.data
        if last:
            d.entries.popitem()
        else:
            del d.entries[name]
        d.index = None
        dbytes, dinodes = self._contrib(child)
        self._charge(vol, parent.ino, -dbytes, -dinodes)
        self._remove_parent(child, parent.ino)
        if child.is_dir:
            parent.nlink -= 1

    def _trash(self, vol: Volume, slice_id: int, slice_size: int, now: int) -> None:
        """A record of ``slice_id`` went: the slice goes to the trash unless
        another record still holds it (then it has one holder fewer)."""
        # a hole record has no blocks; a repo slice's blocks are in its bucket
        if slice_id == HOLE or is_repo_slice(slice_id):
            return
        extra = vol.shared.get(slice_id)
        if extra is None:
            vol.trash += _TRASH.pack(slice_id, slice_size, now)
        elif extra > 1:
            vol.shared[slice_id] = extra - 1
        else:
            del vol.shared[slice_id]

    @staticmethod
    def share(vol: Volume, data: bytes | dict[int, bytes] | None) -> None:
        """Every slice of the records ``data`` gains a holder (a file cloned
        from them): the mirror of :meth:`_trash`."""
        shared = vol.shared
        for rec in _all_records(data):
            sid = rec[1]
            if sid != HOLE and not is_repo_slice(sid):
                shared[sid] = shared.get(sid, 0) + 1

    @staticmethod
    def keeps(expect: int, keep: bool, ino: int) -> bool:
        """Whether a command stamped ``(expect, keep)`` keeps ``ino`` as an orphan
        when it drops its last link. ``expect`` 0 is an unstamped command (the
        state machine alone, as in tests): ``keep`` decides. A stamped command
        that drops another inode than the leader predicted keeps it."""
        return keep if expect in (0, ino) else True

    def _drop_link(self, vol: Volume, child: Inode, now: int, keep: bool = False) -> None:
        """After a dentry of ``child`` went: free it if nothing holds it any more."""
        if child.is_dir:
            child.nlink = 0
            del vol.inodes[child.ino]
            return
        child.nlink -= 1
        child.ctime = now
        if child.nlink == 0:
            if keep and _kind(child.mode) == _S_IFREG:
                vol.orphans.add(child.ino)
            else:
                self._free(vol, child, now)

    def _free(self, vol: Volume, inode: Inode, now: int) -> None:
        if _kind(inode.mode) == _S_IFREG:
            for rec in _all_records(inode.data):
                self._trash(vol, rec[1], rec[5], now)
                if is_repo_slice(rec[1]):
                    self.repo_objects.pop(rec[1], None)
        vol.used_bytes -= inode.stored
        del vol.inodes[inode.ino]

    def _store(self, vol: Volume, inode: Inode, delta: int) -> None:
        """Change a file's stored bytes, keeping usage of every directory linking it."""
        if not delta:
            return
        inode.stored += delta
        vol.used_bytes += delta
        for p in inode.parents():
            self._charge(vol, p, delta, 0)

    @staticmethod
    def _put_chunk(inode: Inode, chunk: int, old: list[Rec], new: list[Rec]) -> None:
        """Replace a chunk's records ``old`` with ``new``, keeping ``Inode.blocks``."""
        inode.blocks += _recs_blocks(new) - _recs_blocks(old)
        inode.data = _store_chunk(inode.data, chunk, new)

    def _check_store(self, vol: Volume, inode: Inode, delta: int) -> None:
        """Quotas and capacity for a file storing ``delta`` more bytes."""
        if delta <= 0:
            return
        if isinstance(inode.parent, int):
            if inode.parent:
                self._check_quota(vol, inode.parent, delta, 0)
        else:  # hard links: an ancestor of several links grows by each
            need: dict[int, int] = {}
            for p in inode.parents():
                for a in self._ancestors(vol, p):
                    need[a.ino] = need.get(a.ino, 0) + delta
            for ino, grow in need.items():
                d: Dir = vol.inodes[ino].data
                if d.qbytes is not None and d.ubytes + grow > d.qbytes:
                    raise QuotaExceeded(f"byte quota {d.qbytes} of directory {ino}")
        self._check_space(vol, delta)

    @staticmethod
    def _touch(inode: Inode, now: int) -> None:
        inode.mtime = inode.ctime = now

    # -- attributes ---------------------------------------------------------------

    @staticmethod
    def attr(inode: Inode) -> Attr:
        kind = _kind(inode.mode)
        rdev = inode.data if kind in (stat.S_IFCHR, stat.S_IFBLK) else 0
        return _new_attr(
            Attr,
            (
                inode.ino,
                inode.mode,
                inode.uid,
                inode.gid,
                inode.nlink,
                DIR_SIZE if kind == _S_IFDIR else inode.size,
                inode.atime,
                inode.mtime,
                inode.ctime,
                rdev,
                0,  # generation: inode numbers are never reused
                inode.version,
                DIR_SIZE // 512 if kind == _S_IFDIR else inode.blocks * 8,
            ),
        )

    # -- volumes and sessions ------------------------------------------------------

    def _create_volume(self, cmd: C.CreateVolume) -> dict[str, Any]:
        if self.is_deleted(cmd.name):
            raise Exists(f"volume {cmd.name!r} is deleted but its blocks are still being collected (see cachefs gc)")
        if cmd.name in self.volumes:
            raise Exists(f"volume {cmd.name!r} exists")
        if cmd.backing:
            self._check_backing_is_its_own(cmd)
        spec = VolumeSpec(cmd.policy, cmd.compression, cmd.block_size, cmd.pg_count, cmd.backing,
                          cmd.backing_endpoint, cmd.backing_region)  # fmt: skip
        self.cluster.add_volume(cmd.name, spec)
        vol = self.volumes[cmd.name] = Volume(cmd.name, cmd.now_ns)
        vol.token_hash = cmd.token_hash
        return spec.to_dict()

    def _check_backing_is_its_own(self, cmd: C.CreateVolume) -> None:
        """No two volumes share a store's prefix, one inside the other: gc
        deletes the objects under a volume's prefix that it does not reference."""
        for name, other in self.cluster.volumes.items():
            if not other.backing or other.endpoint != cmd.backing_endpoint:
                continue
            if other.backing.startswith(cmd.backing) or cmd.backing.startswith(other.backing):
                raise Exists(f"volume {name!r} keeps its blocks in {other.backing}: volume {cmd.name!r} "
                             f"needs a prefix of its own, not {cmd.backing}")

    def _delete_volume(self, cmd: C.DeleteVolume) -> dict[str, Any]:
        """See :class:`~cachefs.commands.DeleteVolume`."""
        vol = self._vol(cmd.name)
        open_sessions = sorted(sid for sid, s in self.sessions.items() if s.volume == cmd.name)
        if open_sessions and not cmd.force:
            raise Busy(f"volume {cmd.name!r} is mounted: {len(open_sessions)} session(s) open "
                       f"(unmount it, or delete with --force)")  # fmt: skip
        linked = sorted(link.id for link in self.links.values() if link.volume == cmd.name)
        if linked:
            raise Busy(f"volume {cmd.name!r} has directories linked to S3 (links {linked}): unlink them first")
        for sid in open_sessions:
            self._close_session(C.CloseSession(sid, now_ns=cmd.now_ns))
        before = len(vol.trash)
        for inode in list(vol.inodes.values()):
            if _kind(inode.mode) == _S_IFREG:
                self._free(vol, inode, cmd.now_ns)
        tomb = Volume(cmd.name, vol.created_ns)
        tomb.trash = vol.trash
        tomb.next_ino = vol.next_ino
        tomb.deleted_ns = cmd.now_ns
        self.volumes[cmd.name] = tomb
        self.jobs.drop_volume(cmd.name)
        trashed = (len(vol.trash) - before) // _TRASH.size
        return {"name": cmd.name, "sessions_closed": len(open_sessions), "slices_trashed": trashed}

    def _submit_job(self, cmd: C.SubmitJob) -> dict[str, Any]:
        self._vol(cmd.volume)
        return self.jobs.submit(cmd)

    def _drop_volume(self, cmd: C.DropVolume) -> None:
        vol = self._gc_vol(cmd.volume)
        if not vol.deleted_ns:
            raise InvalidArgument(f"volume {cmd.volume!r} is not deleted (cachefs volume delete)")
        if vol.trash:
            raise Busy(f"volume {cmd.volume!r} still has {len(vol.trash) // _TRASH.size} trashed slices")
        del self.volumes[cmd.volume]
        self.cluster.remove_volume(cmd.volume)

    def _clone_entry(self, cmd: C.CloneEntry) -> dict[str, Any]:
        from .trees import clone_entry  # trees.py builds on this module's types

        return clone_entry(self, cmd)

    def _clone_dir(self, cmd: C.CloneDir) -> dict[str, Any]:
        from .trees import clone_dir

        return clone_dir(self, cmd)

    def _delete_tree(self, cmd: C.DeleteTree) -> dict[str, Any]:
        from .trees import delete_tree

        return delete_tree(self, cmd)

    def _purge_tree(self, cmd: C.PurgeTree) -> int:
        from .trees import purge_tree

        return purge_tree(self, cmd)

    def tree_deletes(self, volume: str) -> list[dict[str, Any]]:
        vol = self._vol(volume)
        return [{"ino": ino, "since_ns": since, "inodes": total, "left": vol.inodes[ino].data.uinodes + 1}
                for ino, (since, total) in vol.doomed.items()]  # fmt: skip

    def _restore_volume(self, cmd: C.RestoreVolume) -> dict[str, Any]:
        from .backup import parse, restore  # backup.py builds on this module's types

        return restore(self, parse(cmd.blob, "the dump"))

    def _set_volume_access(self, cmd: C.SetVolumeAccess) -> dict[str, Any]:
        self._vol(cmd.name).token_hash = cmd.token_hash
        return {"name": cmd.name, "open": not cmd.token_hash}

    def check_volume_token(self, volume: str, token: str | None) -> None:
        """Refuse a mount of a token-protected volume without its token."""
        vol = self._vol(volume)
        if not vol.token_hash:
            return
        offered = hash_token(token) if token else ""
        if not hmac.compare_digest(offered, vol.token_hash):
            what = "a wrong" if token else "no"
            raise PermissionDenied(
                f"volume {volume!r} needs its mount token; {what} token was given"
            )

    def check_session_grant(self, owner: str, volume: str) -> None:
        """Refuse a client's call on a token-protected volume unless ``owner``
        has a session there: its mount proved the token, and the grant ends
        with its last session (so it survives a failover, as sessions do)."""
        vol = self.volumes.get(volume)
        if vol is not None and vol.token_hash and not self.session_counts.get((owner, volume)):
            raise PermissionDenied(
                f"volume {volume!r} needs its mount token: mount it with the token first"
            )

    def add_session(self, sid: str, session: Session) -> None:
        self.sessions[sid] = session
        key = (session.owner, session.volume)
        self.session_counts[key] = self.session_counts.get(key, 0) + 1

    def _set_volume_compression(self, cmd: C.SetVolumeCompression) -> dict[str, Any]:
        self._vol(cmd.name)
        return self.cluster.set_compression(cmd.name, cmd.compression)

    def _mount_volume(self, cmd: C.MountVolume) -> MountInfo:
        self._vol(cmd.volume)
        if not cmd.client_id:
            raise InvalidArgument("mount_volume needs a client_id")
        session = f"{cmd.client_id}/{self.applied_index}"
        if session in self.sessions:  # only without a log index (tests applying directly)
            session = f"{cmd.client_id}/{self.applied_index}.{len(self.sessions)}"
        self.add_session(session, Session(cmd.client_id, cmd.volume, cmd.leases))
        return MountInfo(ROOT, session, self.cluster.volumes[cmd.volume].to_dict())

    def _close_session(self, cmd: C.CloseSession) -> None:
        """The leader then drops the session's opens and purges orphans it held."""
        s = self.sessions.pop(cmd.session, None)
        if s is None:
            raise NotFound(f"no session {cmd.session!r}")
        key = (s.owner, s.volume)
        left = self.session_counts[key] - 1
        if left:
            self.session_counts[key] = left
        else:
            del self.session_counts[key]

    def _purge_orphans(self, cmd: C.PurgeOrphans) -> int:
        """Free the listed orphans (others, and inodes no longer orphans, are skipped)."""
        vol = self._vol(cmd.volume)
        freed = 0
        for ino in cmd.inos:
            if ino in vol.orphans:
                vol.orphans.discard(ino)
                self._free(vol, vol.inodes[ino], cmd.now_ns)
                freed += 1
        return freed

    def check_open(self, volume: str, ino: int, session: str) -> Attr:
        """What the leader checks before it counts an open: the session is on
        this volume and the inode a regular file (an orphan too); its attrs."""
        vol = self._vol(volume)
        s = self.sessions.get(session)
        if s is None or s.volume != volume:
            raise NotFound(f"no session {session!r} on volume {volume!r}")
        inode = self._inode(vol, ino)
        if inode.is_dir:
            raise IsADirectory("open tracks regular files only (directories need no open)")
        if _kind(inode.mode) != _S_IFREG:
            raise InvalidArgument("open tracks regular files only")
        return self.attr(inode)

    def predict_drop(self, volume: str, parent: int, name: bytes) -> int:
        """The regular file whose link ``parent/name`` names now (0 if none):
        the inode an unlink or a rename over it would drop, for the stamp."""
        vol = self.volumes.get(volume)
        if vol is None:
            return 0
        d = vol.inodes.get(parent)
        if d is None or not d.is_dir:
            return 0
        ino = self._lookup_ino(d.data, name)
        if ino is None or _kind(vol.inodes[ino].mode) != _S_IFREG:
            return 0
        return ino

    # -- namespace mutations -----------------------------------------------------------

    def _create(
        self,
        vol: Volume,
        parent_ino: int,
        name: bytes,
        mode: int,
        uid: int,
        gid: int,
        now: int,
        data: Any,
        size: int = 0,
    ) -> Attr:
        parent = self._dir(vol, parent_ino)
        if name in parent.data.entries:
            raise Exists(f"{name!r} exists in directory {parent_ino}")
        is_dir = _kind(mode) == _S_IFDIR
        self._check_quota(vol, parent_ino, 0, 1)
        if is_dir and parent.nlink >= LINK_MAX:
            raise NotPermitted(f"directory {parent_ino} has too many subdirectories")
        inode = Inode(self._alloc_ino(vol), mode, uid, gid, now, data)
        if is_dir:
            inode.nlink = 2
        inode.size = size
        vol.inodes[inode.ino] = inode
        self._add_entry(vol, parent, name, inode)
        self._touch(parent, now)
        return self.attr(inode)

    def _mknod(self, cmd: C.Mknod) -> Attr:
        vol = self._vol(cmd.volume)
        mode = cmd.mode if _kind(cmd.mode) else cmd.mode | _S_IFREG
        kind = _kind(mode)
        data = cmd.rdev if kind in (stat.S_IFCHR, stat.S_IFBLK) else None
        return self._create(vol, cmd.parent, cmd.name, mode, cmd.uid, cmd.gid, cmd.now_ns, data)

    def _mkdir(self, cmd: C.Mkdir) -> Attr:
        vol = self._vol(cmd.volume)
        mode = (cmd.mode & 0o7777) | _S_IFDIR
        return self._create(vol, cmd.parent, cmd.name, mode, cmd.uid, cmd.gid, cmd.now_ns, Dir())

    def _symlink(self, cmd: C.Symlink) -> Attr:
        vol = self._vol(cmd.volume)
        return self._create(
            vol,
            cmd.parent,
            cmd.name,
            _S_IFLNK | 0o777,
            cmd.uid,
            cmd.gid,
            cmd.now_ns,
            cmd.target,
            size=len(cmd.target),
        )

    def _link(self, cmd: C.Link) -> Attr:
        vol = self._vol(cmd.volume)
        inode = self._inode(vol, cmd.ino)
        if inode.is_dir:
            raise NotPermitted("cannot hard-link a directory")
        if inode.nlink == 0:
            raise NotFound(f"inode {cmd.ino} was unlinked")
        if inode.nlink >= LINK_MAX:
            raise NotPermitted(f"inode {cmd.ino} has {LINK_MAX} links")
        parent = self._dir(vol, cmd.new_parent)
        if cmd.new_name in parent.data.entries:
            raise Exists(f"{cmd.new_name!r} exists in directory {cmd.new_parent}")
        self._check_quota(vol, cmd.new_parent, inode.stored, 1)
        self._add_entry(vol, parent, cmd.new_name, inode)
        inode.nlink += 1
        inode.ctime = cmd.now_ns
        self._touch(parent, cmd.now_ns)
        return self.attr(inode)

    def _unlink(self, cmd: C.Unlink) -> Attr:
        """The directory's attributes after the removal (the session that
        removed the name keeps them under its lease: the kernel asks next)."""
        vol = self._vol(cmd.volume)
        parent = self._dir(vol, cmd.parent)
        ino = self._lookup_ino(parent.data, cmd.name)
        if ino is None:
            raise NotFound(f"no {cmd.name!r} in directory {cmd.parent}")
        child = vol.inodes[ino]
        if child.is_dir:
            raise IsADirectory(f"{cmd.name!r} is a directory")
        self._remove_entry(vol, parent, cmd.name, child)
        self._touch(parent, cmd.now_ns)
        self._drop_link(vol, child, cmd.now_ns, self.keeps(cmd.expect, cmd.keep, ino))
        return self.attr(parent)

    def _rmdir(self, cmd: C.Rmdir) -> Attr:
        """The directory's attributes after the removal, as :meth:`_unlink`."""
        vol = self._vol(cmd.volume)
        parent = self._dir(vol, cmd.parent)
        ino = self._lookup_ino(parent.data, cmd.name)
        if ino is None:
            raise NotFound(f"no {cmd.name!r} in directory {cmd.parent}")
        child = vol.inodes[ino]
        if not child.is_dir:
            raise NotADirectory(f"{cmd.name!r} is not a directory")
        if child.data.entries:
            raise NotEmpty(f"directory {cmd.name!r} is not empty")
        self._remove_entry(vol, parent, cmd.name, child)
        self._touch(parent, cmd.now_ns)
        self._drop_link(vol, child, cmd.now_ns)
        return self.attr(parent)

    def _is_ancestor(self, vol: Volume, ancestor: int, ino: int) -> bool:
        return any(inode.ino == ancestor for inode in self._ancestors(vol, ino))

    def _rename(self, cmd: C.Rename) -> Renamed | None:
        """The moved inode's and both directories' attributes after the move
        (the session that moved it keeps them under its leases), or None
        when nothing moved (an exchange, two links of one inode)."""
        if cmd.new_volume is not None and cmd.new_volume != cmd.volume:
            raise CrossDevice("rename across volumes")
        vol = self._vol(cmd.volume)
        now = cmd.now_ns
        src_dir = self._dir(vol, cmd.parent)
        dst_dir = self._dir(vol, cmd.new_parent)
        src_ino = self._lookup_ino(src_dir.data, cmd.name)
        if src_ino is None:
            raise NotFound(f"no {cmd.name!r} in directory {cmd.parent}")
        src = vol.inodes[src_ino]
        dst_ino = self._lookup_ino(dst_dir.data, cmd.new_name)
        dst = vol.inodes[dst_ino] if dst_ino is not None else None
        if cmd.flags & C.RENAME_EXCHANGE:
            if dst is None:
                raise NotFound(f"no {cmd.new_name!r} in directory {cmd.new_parent}")
            self._exchange(vol, cmd, src_dir, src, dst_dir, dst)
            return None
        if dst is not None and cmd.flags & C.RENAME_NOREPLACE:
            raise Exists(f"{cmd.new_name!r} exists in directory {cmd.new_parent}")
        if dst is src:
            return None  # two links of one inode: POSIX says do nothing
        if src.is_dir and self._is_ancestor(vol, src.ino, dst_dir.ino):
            raise InvalidArgument("cannot move a directory into its own subtree")
        if dst is not None:
            if src.is_dir and not dst.is_dir:
                raise NotADirectory(f"{cmd.new_name!r} is not a directory")
            if not src.is_dir and dst.is_dir:
                raise IsADirectory(f"{cmd.new_name!r} is a directory")
            if dst.is_dir and dst.data.entries:
                raise NotEmpty(f"directory {cmd.new_name!r} is not empty")
        if (
            src.is_dir
            and dst is None
            and cmd.new_parent != cmd.parent
            and dst_dir.nlink >= LINK_MAX
        ):
            raise NotPermitted(f"directory {cmd.new_parent} has too many subdirectories")
        sbytes, sinodes = self._contrib(src)
        if dst is not None:
            dbytes, dinodes = self._contrib(dst)
            sbytes, sinodes = sbytes - dbytes, sinodes - dinodes
        common = {i.ino for i in self._ancestors(vol, src_dir.ino)}
        self._check_quota(vol, dst_dir.ino, sbytes, sinodes, stop=common)
        # all checks done: from here on nothing fails
        self._remove_entry(vol, src_dir, cmd.name, src)
        if dst is not None:
            self._replace_entry(vol, dst_dir, cmd.new_name, dst, src)
            self._drop_link(vol, dst, now, self.keeps(cmd.expect, cmd.keep, dst.ino))
        else:
            self._add_entry(vol, dst_dir, cmd.new_name, src)
        src.ctime = now
        self._touch(src_dir, now)
        self._touch(dst_dir, now)
        return Renamed(self.attr(src), self.attr(src_dir), self.attr(dst_dir))

    def _replace_entry(
        self, vol: Volume, parent: Inode, name: bytes, old: Inode, new: Inode
    ) -> None:
        """Point ``name`` at ``new`` in place: the name keeps its cookie and its
        place in readdir order."""
        d: Dir = parent.data
        cookie_bits = d.entries[name] & ~INO_MASK
        ob, oi = self._contrib(old)
        self._charge(vol, parent.ino, -ob, -oi)
        self._remove_parent(old, parent.ino)
        if old.is_dir:
            parent.nlink -= 1
        d.entries[name] = cookie_bits | new.ino
        d.index = None
        self._add_parent(new, parent.ino)
        nb, ni = self._contrib(new)
        self._charge(vol, parent.ino, nb, ni)
        if new.is_dir:
            parent.nlink += 1

    def _exchange(
        self, vol: Volume, cmd: C.Rename, src_dir: Inode, src: Inode, dst_dir: Inode, dst: Inode
    ) -> None:
        if src is dst:
            return
        if src.is_dir and self._is_ancestor(vol, src.ino, dst_dir.ino):
            raise InvalidArgument("cannot move a directory into its own subtree")
        if dst.is_dir and self._is_ancestor(vol, dst.ino, src_dir.ino):
            raise InvalidArgument("cannot move a directory into its own subtree")
        sb, si = self._contrib(src)
        db, di = self._contrib(dst)
        if src_dir is not dst_dir:
            src_side = {i.ino for i in self._ancestors(vol, src_dir.ino)}
            dst_side = {i.ino for i in self._ancestors(vol, dst_dir.ino)}
            self._check_quota(vol, dst_dir.ino, sb - db, si - di, stop=src_side)
            self._check_quota(vol, src_dir.ino, db - sb, di - si, stop=dst_side)
        # all checks done: swap the two entries in place, keeping both cookies
        s: Dir = src_dir.data
        t: Dir = dst_dir.data
        s_cookie = s.entries[cmd.name] & ~INO_MASK
        t_cookie = t.entries[cmd.new_name] & ~INO_MASK
        self._charge(vol, src_dir.ino, db - sb, di - si)
        self._charge(vol, dst_dir.ino, sb - db, si - di)
        s.entries[cmd.name] = s_cookie | dst.ino
        t.entries[cmd.new_name] = t_cookie | src.ino
        s.index = t.index = None
        self._remove_parent(src, src_dir.ino)
        self._remove_parent(dst, dst_dir.ino)
        self._add_parent(src, dst_dir.ino)
        self._add_parent(dst, src_dir.ino)
        if src.is_dir != dst.is_dir and src_dir is not dst_dir:
            moved = 1 if src.is_dir else -1
            src_dir.nlink -= moved
            dst_dir.nlink += moved
        src.ctime = dst.ctime = cmd.now_ns
        self._touch(src_dir, cmd.now_ns)
        self._touch(dst_dir, cmd.now_ns)

    def _setattr(self, cmd: C.SetAttr) -> Attr:
        vol = self._vol(cmd.volume)
        inode = self._inode(vol, cmd.ino)
        kind = _kind(inode.mode)
        if cmd.size is not None:
            if kind == _S_IFDIR:
                raise IsADirectory("cannot truncate a directory")
            if kind != _S_IFREG:
                raise InvalidArgument("can only truncate regular files")
        if cmd.mode is not None and _kind(cmd.mode) and _kind(cmd.mode) != kind:
            raise InvalidArgument("chmod cannot change the file type")
        now = cmd.now_ns
        if cmd.mode is not None:
            inode.mode = kind | (cmd.mode & 0o7777)
        if cmd.uid is not None:
            inode.uid = cmd.uid
        if cmd.gid is not None:
            inode.gid = cmd.gid
        if cmd.size is not None:
            self._truncate(vol, inode, cmd.size, now)
            inode.mtime = now
        if cmd.atime_ns is not None:
            inode.atime = cmd.atime_ns
        if cmd.mtime_ns is not None:
            inode.mtime = cmd.mtime_ns
        inode.ctime = now
        return self.attr(inode)

    def _truncate(self, vol: Volume, inode: Inode, size: int, now: int) -> None:
        """Set the size; records past it go (their slices to the trash), one
        across it is cut. Stores nothing, so it needs no space."""
        if size < inode.size:
            first = size // CHUNK_SIZE
            chunks = sorted({r[0] for r in _all_records(inode.data) if r[0] >= first})
            for chunk in chunks:
                cut = size - chunk * CHUNK_SIZE  # bytes of this chunk that stay
                keep: list[Rec] = []
                recs = _chunk_records(inode.data, chunk)
                for slice_id, pos, length, offset, ssize in recs:
                    if pos >= cut:
                        self._trash(vol, slice_id, ssize, now)
                        self._store(vol, inode, -ssize)
                    elif pos + length > cut:
                        keep.append((slice_id, pos, cut - pos, offset, ssize))
                    else:
                        keep.append((slice_id, pos, length, offset, ssize))
                self._put_chunk(inode, chunk, recs, keep)
        if size != inode.size:
            inode.version += 1
        inode.size = size

    def _setxattr(self, cmd: C.SetXattr) -> None:
        vol = self._vol(cmd.volume)
        inode = self._inode(vol, cmd.ino)
        present = inode.xattrs is not None and cmd.name in inode.xattrs
        if cmd.flags == C.XATTR_CREATE and present:
            raise Exists(f"xattr {cmd.name!r} exists")
        if cmd.flags == C.XATTR_REPLACE and not present:
            raise NoData(f"no xattr {cmd.name!r}")
        if inode.xattrs is None:
            inode.xattrs = {}
        inode.xattrs[cmd.name] = cmd.value
        inode.ctime = cmd.now_ns

    def _removexattr(self, cmd: C.RemoveXattr) -> None:
        vol = self._vol(cmd.volume)
        inode = self._inode(vol, cmd.ino)
        if inode.xattrs is None or cmd.name not in inode.xattrs:
            raise NoData(f"no xattr {cmd.name!r}")
        del inode.xattrs[cmd.name]
        if not inode.xattrs:
            inode.xattrs = None
        inode.ctime = cmd.now_ns

    def _set_quota(self, cmd: C.SetQuota) -> Usage:
        vol = self._vol(cmd.volume)
        inode = self._dir(vol, cmd.ino)
        d: Dir = inode.data
        d.qbytes = cmd.max_bytes
        d.qinodes = cmd.max_inodes
        return self.usage(cmd.volume, cmd.ino)

    # -- data ---------------------------------------------------------------------

    def _alloc_slices(self, cmd: C.AllocSlices) -> int:
        first = self.next_slice
        self.next_slice += cmd.count
        return first

    def _check_slice(self, slice_id: int) -> None:
        if slice_id >= self.next_slice:
            raise InvalidArgument(f"slice {slice_id} was never allocated")
        if slice_id < self.slice_floor:
            raise SliceExpired(f"slice {slice_id} is sealed (below {self.slice_floor}): its blocks may be "
                               "collected; store the data under a new slice")

    def _seal_slices(self, cmd: C.SealSlices) -> int:
        self.slice_floor = max(self.slice_floor, min(cmd.floor, self.next_slice))
        return self.slice_floor

    def _write_slice(self, cmd: C.WriteSlice) -> Attr:
        vol = self._vol(cmd.volume)
        inode = self._inode(vol, cmd.ino)
        kind = _kind(inode.mode)
        if kind == _S_IFDIR:
            raise IsADirectory(f"inode {cmd.ino} is a directory")
        if kind != _S_IFREG:
            raise InvalidArgument(f"inode {cmd.ino} is not a regular file")
        self._check_slice(cmd.slice_id)
        end = cmd.chunk * CHUNK_SIZE + cmd.pos + cmd.length
        if end > C.MAX_FILE_SIZE:
            raise InvalidArgument("write past the largest file size")
        keep: list[Rec] = []
        gone: list[Rec] = []
        lo, hi = cmd.pos, cmd.pos + cmd.length
        recs = _chunk_records(inode.data, cmd.chunk)
        for rec in recs:
            (gone if lo <= rec[1] and rec[1] + rec[2] <= hi else keep).append(rec)  # fully overwritten
        ssize = cmd.offset + cmd.length
        delta = ssize - sum(rec[4] for rec in gone)
        self._check_store(vol, inode, delta)
        for rec in gone:
            self._trash(vol, rec[0], rec[4], cmd.now_ns)
        keep.append((cmd.slice_id, cmd.pos, cmd.length, cmd.offset, ssize))
        self._put_chunk(inode, cmd.chunk, recs, keep)
        self._store(vol, inode, delta)
        inode.size = max(inode.size, end)
        inode.version += 1
        inode.mtime = inode.ctime = cmd.mtime_ns
        self._queue_repairs(vol, cmd.slice_id, cmd.short, cmd.now_ns)
        return self.attr(inode)

    @staticmethod
    def _queue_repairs(vol: Volume, slice_id: int, blocks: tuple[int, ...], now: int) -> None:
        for index in blocks:
            vol.repairs.setdefault((slice_id, index), now)

    def _compact_chunk(self, cmd: C.CompactChunk) -> Attr:
        vol = self._vol(cmd.volume)
        inode = self._inode(vol, cmd.ino)
        if _kind(inode.mode) != _S_IFREG:
            raise InvalidArgument(f"inode {cmd.ino} is not a regular file")
        self._check_slice(cmd.slice_id)
        recs = _chunk_records(inode.data, cmd.chunk)
        if [r[:4] for r in recs] != cmd.records():
            raise Stale("the chunk changed since it was read; compact again")
        end = max(r[1] + r[2] for r in recs)
        if cmd.length != end:
            raise InvalidArgument(f"a compaction of records ending at {end} must be {end} bytes, not {cmd.length}")
        delta = cmd.length - sum(rec[4] for rec in recs)
        self._check_store(vol, inode, delta)
        for rec in recs:
            self._trash(vol, rec[0], rec[4], cmd.now_ns)
        self._put_chunk(inode, cmd.chunk, recs, [(cmd.slice_id, 0, cmd.length, 0, cmd.length)])
        self._store(vol, inode, delta)
        self._queue_repairs(vol, cmd.slice_id, cmd.short, cmd.now_ns)
        return self.attr(inode)

    def _fallocate(self, cmd: C.Fallocate) -> Attr:
        """See :class:`~cachefs.commands.Fallocate`: O(records), not O(range)."""
        vol = self._vol(cmd.volume)
        inode = self._inode(vol, cmd.ino)
        kind = _kind(inode.mode)
        if kind == _S_IFDIR:
            raise IsADirectory(f"inode {cmd.ino} is a directory")
        if kind != _S_IFREG:
            raise InvalidArgument(f"inode {cmd.ino} is not a regular file")
        end = cmd.offset + cmd.length
        keep_size = bool(cmd.mode & C.FALLOC_FL_KEEP_SIZE)
        new_size = inode.size if keep_size else max(inode.size, end)
        if not cmd.mode & (C.FALLOC_FL_PUNCH_HOLE | C.FALLOC_FL_ZERO_RANGE):
            self._check_store(vol, inode, cmd.length)  # room for it; nothing is stored yet
        else:
            self._hole(vol, inode, cmd.offset, min(end, new_size), cmd.now_ns)
            inode.version += 1
            inode.mtime = cmd.now_ns
        if new_size != inode.size:
            inode.size = new_size
            inode.version += 1
            inode.mtime = cmd.now_ns
        inode.ctime = cmd.now_ns
        return self.attr(inode)

    def _hole(self, vol: Volume, inode: Inode, lo: int, hi: int, now: int) -> None:
        """Make ``[lo, hi)`` read as zeros: a hole record in each chunk that
        holds records there (a chunk without any reads as zeros already)."""
        if lo >= hi:
            return
        first, last = lo // CHUNK_SIZE, (hi - 1) // CHUNK_SIZE
        for chunk in sorted({r[0] for r in _all_records(inode.data) if first <= r[0] <= last}):
            base = chunk * CHUNK_SIZE
            a, b = max(lo, base) - base, min(hi, base + CHUNK_SIZE) - base
            keep: list[Rec] = []
            freed = 0
            recs = _chunk_records(inode.data, chunk)
            for rec in recs:
                if a <= rec[1] and rec[1] + rec[2] <= b:  # wholly inside: gone
                    self._trash(vol, rec[0], rec[4], now)
                    freed += rec[4]
                else:
                    keep.append(rec)
            keep.append((HOLE, a, b - a, 0, 0))
            self._put_chunk(inode, chunk, recs, keep)
            self._store(vol, inode, -freed)

    def _purge_trash(self, cmd: C.PurgeTrash) -> int:
        vol = self._gc_vol(cmd.volume)
        drop = set(cmd.slice_ids)
        kept = bytearray()
        purged = 0
        for rec in _TRASH.iter_unpack(vol.trash):
            if rec[0] in drop:
                purged += 1
            else:
                kept += _TRASH.pack(*rec)
        vol.trash = kept
        if vol.repairs:  # their blocks are deleted: nothing left to repair
            vol.repairs = {k: t for k, t in vol.repairs.items() if k[0] not in drop}
        return purged

    def _repairs_done(self, cmd: C.RepairsDone) -> int:
        vol = self._gc_vol(cmd.volume)
        return sum(vol.repairs.pop(block, None) is not None for block in cmd.pairs())

    # -- cluster map -----------------------------------------------------------------

    def _register_node(self, cmd: C.RegisterNode) -> int:
        return self.cluster.register(cmd.kind, cmd.node_id, cmd.addr, cmd.zone, cmd.capacity)

    def _remove_node(self, cmd: C.RemoveNode) -> int:
        return self.cluster.remove(cmd.kind, cmd.node_id)

    # -- data repositories --------------------------------------------------------------

    def _link_repo(self, cmd: C.LinkRepo) -> dict[str, Any]:
        vol = self._vol(cmd.volume)
        self._dir(vol, cmd.ino)
        above = {i.ino for i in self._ancestors(vol, cmd.ino)}
        for link in self.links.values():
            if link.volume != cmd.volume:
                continue
            if link.ino in above:
                raise Exists(f"directory {cmd.ino} is already inside link {link.id} ({link.ino})")
            if link.ino in vol.inodes and cmd.ino in {i.ino for i in self._ancestors(vol, link.ino)}:
                raise Exists(f"directory {cmd.ino} holds link {link.id} already")
        link = RepoLink(self.next_link, cmd)
        self.next_link += 1
        self.links[link.id] = link
        if link.import_mode == "lazy":
            self.lazy_dirs[(link.volume, link.ino)] = (link.id, "")
        exports.index(self)
        return link.to_dict()

    def _unlink_repo(self, cmd: C.UnlinkRepo) -> dict[str, Any]:
        link = self.links.pop(cmd.link_id, None)
        if link is None:
            raise NotFound(f"no repository link {cmd.link_id}")
        self.lazy_dirs = {k: v for k, v in self.lazy_dirs.items() if v[0] != link.id}
        exports.index(self)
        return link.to_dict()

    def _queue_exports(self, cmd: C.QueueExports) -> dict[str, int]:
        return exports.queue_dir(self, self._repo_link(cmd.link_id), cmd.path, cmd.now_ns)

    def _export_done(self, cmd: C.ExportDone) -> dict[str, bool]:
        return exports.export_done(self._repo_link(cmd.link_id), cmd)

    def _release_file(self, cmd: C.ReleaseFile) -> dict[str, int]:
        """See :class:`~cachefs.commands.ReleaseFile`. The file's content,
        size, mtime and version stay: only where its bytes are read from
        changes. A reader holding the old slice list reads the old blocks
        until gc deletes them (a grace later), then reads the list again."""
        link = self._repo_link(cmd.link_id)
        if link.volume != cmd.volume:
            raise InvalidArgument(f"repository link {link.id} is not in volume {cmd.volume!r}")
        vol = self._vol(link.volume)
        parent = self._dir(vol, cmd.parent)
        if self._lookup_ino(parent.data, cmd.name) != cmd.ino:
            raise Stale(f"{cmd.name!r} in directory {cmd.parent} is no longer inode {cmd.ino}")
        inode = vol.inodes[cmd.ino]
        if _kind(inode.mode) != _S_IFREG or inode.nlink != 1:
            raise InvalidArgument(f"inode {cmd.ino}: only a regular file with one name can be released")
        if inode.version != cmd.version:
            raise Stale(f"inode {cmd.ino} changed since its content was compared with the bucket's object")
        if cmd.ino in link.puts:
            raise Busy(f"inode {cmd.ino} has an export queued: the bucket does not have its content yet")
        key = exports.key_of(self, vol, link, cmd.parent, cmd.name)
        if key is None:
            raise InvalidArgument(f"inode {cmd.ino} is not under repository link {link.id}")
        if link.owns(self, inode):
            return {"released": 0}  # its content is the bucket's already
        released = inode.stored
        for rec in _all_records(inode.data):
            self._trash(vol, rec[1], rec[5], cmd.now_ns)  # repo slices have no blocks to trash
            self.repo_objects.pop(rec[1], None)
        self._store(vol, inode, -inode.stored)
        inode.data = None
        self._set_repo_content(vol, link, inode, key[len(link.prefix):], inode.size, cmd.etag)
        if not inode.size:
            link.empties.add(inode.ino)
        return {"released": released}

    def _repo_link(self, link_id: int) -> RepoLink:
        link = self.links.get(link_id)
        if link is None:
            raise NotFound(f"no repository link {link_id}")
        return link

    def index_lazy(self) -> None:
        """Rebuild ``lazy_dirs`` and ``exporting`` from the links (after loading a snapshot)."""
        exports.index(self)
        self.lazy_dirs = {}
        for link in self.links.values():
            vol = self.volumes.get(link.volume)
            if link.import_mode != "lazy" or vol is None or link.ino not in vol.inodes:
                continue
            for path in link.pending:
                d = self._walk(vol, link, path)
                if d is not None:
                    self.lazy_dirs[(link.volume, d.ino)] = (link.id, path)

    def _import_objects(self, cmd: C.ImportObjects) -> dict[str, Any]:
        link = self.links.get(cmd.link_id)
        if link is None:
            raise NotFound(f"no repository link {cmd.link_id}")
        vol = self._vol(link.volume)
        if link.ino not in vol.inodes:
            raise NotFound(f"the directory of repository link {link.id} is gone")
        self._dir(vol, link.ino)
        counts = {"created": 0, "updated": 0, "unchanged": 0, "skipped": 0, "deleted": 0}
        rows = cmd.objects()
        d = self._walk(vol, link, cmd.dir) if cmd.prune else None
        n = len(cmd.dir)
        if d is not None and all(key.startswith(cmd.dir) and "/" not in key[n:] for key, *_ in rows):
            self._import_leaves(vol, link, d, rows, n, cmd.now_ns, counts)  # a delimited listing's page
        else:
            for key, size, mtime, etag in rows:
                counts[self._import_one(vol, link, key, size, mtime, etag, cmd.now_ns)] += 1
        subdirs = cmd.prefixes()
        for sub in subdirs:
            self._import_dir(vol, link, sub, cmd.now_ns)
        if cmd.prune:
            for parent, name, child, path in self._pruned(vol, link, cmd, rows, subdirs):
                counts["deleted"] += self._prune(vol, link, parent, name, child, path, cmd.now_ns)
        link.objects += counts["created"] - counts["deleted"]
        if cmd.dir in link.pending:
            if cmd.done:
                del link.pending[cmd.dir]
                d = self._walk(vol, link, cmd.dir)
                if d is not None:
                    self.lazy_dirs.pop((link.volume, d.ino), None)
            elif cmd.cursor:
                link.pending[cmd.dir] = cmd.cursor
        if cmd.done and not link.pending:
            link.imported_ns = cmd.now_ns
        if subdirs:  # which of them are still to list (what a sync of a lazy link skips)
            return {**counts, "unlisted": [sub for sub in subdirs if sub in link.pending]}
        return counts

    def _import_leaves(
        self, vol: Volume, link: RepoLink, d: Inode, rows: list[tuple[str, int, int, str]], n: int, now: int,
        counts: dict[str, int],
    ) -> None:  # fmt: skip
        """Objects that are all files of directory ``d`` (their keys past ``n``
        characters): :meth:`_import_one` for each, with the directory's
        bookkeeping (quota, usage, mtime) done once for the page."""
        entries = d.data.entries
        new = []
        seen = set()
        for key, size, mtime, etag in rows:
            try:
                name = C.check_name(key[n:].encode())
            except CacheFSError:
                counts["skipped"] += 1
                continue
            if name in seen:  # a hostile page naming a key twice: the first one counts
                counts["skipped"] += 1
                continue
            seen.add(name)
            packed = entries.get(name)
            if packed is None:
                new.append((name, key, size, mtime, etag))
            else:
                counts[self._update_one(vol, link, vol.inodes[packed & INO_MASK], key, size, mtime, etag, now)] += 1
        if not new:
            return
        self._check_quota(vol, d.ino, 0, len(new))
        dd: Dir = d.data
        for name, key, size, mtime, etag in new:
            inode = Inode(self._alloc_ino(vol), _S_IFREG | 0o644, 0, 0, mtime, None)
            vol.inodes[inode.ino] = inode
            inode.parent = d.ino  # what _add_entry does for a new file (it stores no bytes: usage 0, 1)
            dd.entries[name] = (dd.next_cookie << INO_BITS) | inode.ino
            dd.next_cookie += 1
            self._set_repo_content(vol, link, inode, key, size, etag)
            if not size:
                link.empties.add(inode.ino)
        dd.index = None
        self._charge(vol, d.ino, 0, len(new))
        self._touch(d, now)
        counts["created"] += len(new)

    def _walk(self, vol: Volume, link: RepoLink, path: str) -> Inode | None:
        """Directory ``path`` (relative to the link's prefix, "" or ending in "/")."""
        inode = vol.inodes[link.ino]
        for part in path.split("/")[:-1]:
            ino = self._lookup_ino(inode.data, part.encode())
            if ino is None or not vol.inodes[ino].is_dir:
                return None
            inode = vol.inodes[ino]
        return inode

    def _import_dir(self, vol: Volume, link: RepoLink, path: str, now: int) -> None:
        """A listing's common prefix: its directory (and missing parents); a new one is pending."""
        try:
            names = [C.check_name(part.encode()) for part in path.split("/")[:-1]]
        except CacheFSError:
            return  # "a//", "./": no directory can hold it
        parent = vol.inodes[link.ino]
        for depth, name in enumerate(names, 1):
            ino = self._lookup_ino(parent.data, name)
            if ino is None:
                self._create(vol, parent.ino, name, _S_IFDIR | 0o755, 0, 0, now, Dir())
                ino = self._lookup_ino(parent.data, name)
                if depth == len(names):
                    link.pending[path] = ""
                    if link.import_mode == "lazy":
                        self.lazy_dirs[(link.volume, ino)] = (link.id, path)
            parent = vol.inodes[ino]
            if not parent.is_dir:
                return

    def _pruned(
        self, vol: Volume, link: RepoLink, cmd: C.ImportObjects, rows: list[Any], subdirs: list[str]
    ) -> list[tuple[Inode, bytes, Inode, str]]:
        """The names of ``cmd.dir`` its page (``rows``, ``subdirs``: decoded)
        speaks for but does not list: ``(directory, name, inode, path)``, each
        to go if it is (or holds) this link's."""
        d = self._walk(vol, link, cmd.dir)
        if d is None:
            return []
        listed = {key.encode() for key, *_ in rows} | {p.encode() for p in subdirs}
        base, after, last = cmd.dir.encode(), cmd.after.encode(), cmd.cursor.encode()
        out = []
        for name, packed in d.data.entries.items():
            child = vol.inodes[packed & INO_MASK]
            pos = base + name + b"/" if child.is_dir else base + name
            if pos > after and (cmd.done or pos <= last) and pos not in listed:
                out.append((d, name, child, pos.decode(errors="replace")))
        return out

    def _prune(
        self, vol: Volume, link: RepoLink, parent: Inode, name: bytes, child: Inode, path: str, now: int
    ) -> int:
        """Remove ``parent/name`` if this link imported it, or, for a directory,
        what this link imported under it and then the directory if that left it
        empty; files go as orphans (they may be open: the leader purges the
        rest). Returns how many files went."""
        gone = 0
        if child.is_dir:
            for sub, packed in list(child.data.entries.items()):
                grand = vol.inodes[packed & INO_MASK]
                subpath = path + sub.decode(errors="replace") + ("/" if grand.is_dir else "")
                gone += self._prune(vol, link, child, sub, grand, subpath, now)
            if child.data.entries:
                return gone
            link.pending.pop(path, None)
            self.lazy_dirs.pop((link.volume, child.ino), None)
        elif link.owns(self, child):
            link.empties.discard(child.ino)
            gone = 1
        else:
            return 0
        self._remove_entry(vol, parent, name, child)
        self._touch(parent, now)
        self._drop_link(vol, child, now, keep=True)
        return gone

    def _import_one(
        self, vol: Volume, link: RepoLink, key: str, size: int, mtime: int, etag: str, now: int
    ) -> str:
        """One object: what became of it (a key of ``ImportObjects``' reply)."""
        *dirs, leaf = key.split("/")
        try:
            names = [C.check_name(part.encode()) for part in (*dirs, leaf)]
        except CacheFSError:
            return "skipped"  # "a//b", "." parts, over-long names: no file can hold it
        parent = vol.inodes[link.ino]
        for name in names[:-1]:
            ino = self._lookup_ino(parent.data, name)
            if ino is None:
                self._create(vol, parent.ino, name, _S_IFDIR | 0o755, 0, 0, now, Dir())
                ino = self._lookup_ino(parent.data, name)
            parent = vol.inodes[ino]
            if not parent.is_dir:
                return "skipped"
        ino = self._lookup_ino(parent.data, names[-1])
        if ino is None:
            self._check_quota(vol, parent.ino, 0, 1)
            inode = Inode(self._alloc_ino(vol), _S_IFREG | 0o644, 0, 0, mtime, None)
            vol.inodes[inode.ino] = inode
            self._add_entry(vol, parent, names[-1], inode)
            self._touch(parent, now)
            self._set_repo_content(vol, link, inode, key, size, etag)
            if not size:
                link.empties.add(inode.ino)
            return "created"
        return self._update_one(vol, link, vol.inodes[ino], key, size, mtime, etag, now)

    def _update_one(
        self, vol: Volume, link: RepoLink, inode: Inode, key: str, size: int, mtime: int, etag: str, now: int
    ) -> str:
        """An object whose name is taken: a new version of it, or left alone."""
        if _kind(inode.mode) != _S_IFREG:
            return "skipped"
        sids = {rec[1] for rec in _all_records(inode.data)}
        if any(not is_repo_slice(sid) for sid in sids):
            return "skipped"  # written here: the local content wins
        old = next(iter(sids), None)
        if old is None and inode.size:
            return "skipped"  # a sparse local file
        raw = self.repo_objects.get(old) if old is not None else None
        if raw is not None and unpack_repo_object(raw)[2] == etag:
            return "unchanged"
        if old is None and not size:
            return "unchanged"  # an empty object, as imported
        self.repo_objects.pop(old, None)
        inode.data = None
        inode.atime = inode.mtime = mtime
        inode.ctime = now
        inode.version += 1
        self._set_repo_content(vol, link, inode, key, size, etag)
        if size:
            link.empties.discard(inode.ino)
        else:
            link.empties.add(inode.ino)
        return "updated"

    def _set_repo_content(
        self, vol: Volume, link: RepoLink, inode: Inode, key: str, size: int, etag: str
    ) -> None:
        """Point a file at a new repo slice: one record per chunk, no stored bytes."""
        inode.size = size
        inode.blocks = (size + 4095) >> 12  # its records' (chunks are whole 4 KiB blocks)
        if not size:
            return
        sid = REPO_SLICE_BIT | self.next_repo
        self.next_repo += 1
        self.repo_objects[sid] = pack_repo_object(link.id, size, etag, key)
        if size <= CHUNK_SIZE:  # most objects: one record
            inode.data = _REC.pack(0, sid, 0, size, 0, 0)
            return
        last = (size - 1) // CHUNK_SIZE
        recs = b"".join(
            _REC.pack(c, sid, 0, min(CHUNK_SIZE, size - c * CHUNK_SIZE), c * CHUNK_SIZE, 0)
            for c in range(last + 1)
        )
        if last + 1 > FLAT_MAX_RECORDS:
            inode.data = {c: recs[c * _REC.size : (c + 1) * _REC.size] for c in range(last + 1)}
        else:
            inode.data = recs

    # -- reads (run by the queries, on the leader) --------------------------------------

    def lookup(self, volume: str, parent: int, name: bytes) -> Attr:
        C.check_name(name)
        vol = self._vol(volume)
        d = self._dir(vol, parent)
        ino = self._lookup_ino(d.data, name)
        if ino is None:
            raise NotFound(f"no {name!r} in directory {parent}")
        return self.attr(vol.inodes[ino])

    def getattr(self, volume: str, ino: int) -> Attr:
        return self.attr(self._inode(self._vol(volume), ino))

    def readlink(self, volume: str, ino: int) -> bytes:
        inode = self._inode(self._vol(volume), ino)
        if _kind(inode.mode) != _S_IFLNK:
            raise InvalidArgument(f"inode {ino} is not a symlink")
        return inode.data

    def readdir(self, volume: str, ino: int, cookie: int, limit: int) -> list[DirEntry]:
        """Entries after ``cookie`` (0: from the start), at most ``limit`` of them,
        each with its own cookie."""
        if not isinstance(cookie, int) or cookie < 0 or not isinstance(limit, int) or limit < 1:
            raise InvalidArgument("cookie must be >= 0 and limit >= 1")
        vol = self._vol(volume)
        inode = self._inode(vol, ino)
        if not inode.is_dir:
            raise NotADirectory(f"inode {ino} is not a directory")
        d: Dir = inode.data
        out: list[DirEntry] = []
        inodes = vol.inodes
        if cookie and len(d.entries) >= INDEX_MIN_ENTRIES:
            if d.index is None:
                d.index = ([v >> INO_BITS for v in d.entries.values()], list(d.entries))
            cookies, names = d.index
            start = bisect.bisect_right(cookies, cookie)
            for name in names[start : start + limit]:
                packed = d.entries[name]
                out.append(DirEntry(name, self.attr(inodes[packed & INO_MASK]), packed >> INO_BITS))
            return out
        for name, packed in d.entries.items():
            c = packed >> INO_BITS
            if c <= cookie:
                continue
            out.append(DirEntry(name, self.attr(inodes[packed & INO_MASK]), c))
            if len(out) >= limit:
                break
        return out

    def load_dir(
        self, volume: str, ino: int, cookie: int, limit: int, small: int
    ) -> tuple[Attr, list[LoadedEntry], bool]:
        """The directory's attributes, a page of ``readdir`` whose regular
        files up to ``small`` bytes carry chunk 0's slice list, and whether
        more entries follow."""
        page = self.readdir(volume, ino, cookie, limit + 1)
        more = len(page) > limit
        vol = self.volumes[volume]
        out = []
        for name, attr, c in page[:limit]:
            slices = None
            if attr.size <= small and _kind(attr.mode) == _S_IFREG:
                data = vol.inodes[attr.ino].data
                slices = [(s, p, n, o) for s, p, n, o, _ in _chunk_records(data, 0)]
            out.append(LoadedEntry(name, attr, c, slices))
        return self.attr(vol.inodes[ino]), out, more

    def getxattr(self, volume: str, ino: int, name: bytes) -> bytes:
        inode = self._inode(self._vol(volume), ino)
        if inode.xattrs is None or name not in inode.xattrs:
            raise NoData(f"no xattr {name!r}")
        return inode.xattrs[name]

    def listxattr(self, volume: str, ino: int) -> list[bytes]:
        inode = self._inode(self._vol(volume), ino)
        return list(inode.xattrs or ())

    def read_chunk(self, volume: str, ino: int, chunk: int) -> list[tuple[int, int, int, int]]:
        """``(slice_id, pos, length, offset)`` per slice, in commit order."""
        if not isinstance(chunk, int) or not 0 <= chunk < C.U32:
            raise InvalidArgument(f"bad chunk index {chunk!r}")
        inode = self._inode(self._vol(volume), ino)
        if inode.is_dir:
            raise IsADirectory(f"inode {ino} is a directory")
        if _kind(inode.mode) != _S_IFREG:
            raise InvalidArgument(f"inode {ino} is not a regular file")
        return [(s, p, n, o) for s, p, n, o, _ in _chunk_records(inode.data, chunk)]

    def quotas(self, volume: str) -> list[dict[str, Any]]:
        """Directories with a quota and their usage (see ``Q.ListQuotas``); one
        pass over the inodes, and a scan of each such directory's parent for its name."""
        vol = self._vol(volume)
        out = []
        for inode in vol.inodes.values():
            if inode.is_dir and (inode.data.qbytes is not None or inode.data.qinodes is not None):
                d: Dir = inode.data
                out.append({"inode": inode.ino, "path": self._dir_path(vol, inode), "used_bytes": d.ubytes,
                            "used_inodes": d.uinodes, "limit_bytes": d.qbytes, "limit_inodes": d.qinodes})  # fmt: skip
        return sorted(out, key=lambda q: q["path"])

    @staticmethod
    def _dir_path(vol: Volume, inode: Inode) -> bytes:
        names = []
        while inode.ino != ROOT:
            parent = vol.inodes[inode.parent]  # a directory has one parent
            names.append(next(n for n, packed in parent.data.entries.items() if packed & INO_MASK == inode.ino))
            inode = parent
        return b"/" + b"/".join(reversed(names))

    def usage(self, volume: str, ino: int) -> Usage:
        vol = self._vol(volume)
        inode = self._inode(vol, ino)
        if not inode.is_dir:
            raise NotADirectory(f"inode {ino} is not a directory")
        d: Dir = inode.data
        return Usage(d.ubytes, d.uinodes, d.qbytes, d.qinodes)

    def repo_links(self) -> list[dict[str, Any]]:
        return [link.to_dict() for link in self.links.values()]

    def repo_pending(self, link_id: int) -> dict[str, str]:
        link = self.links.get(link_id)
        if link is None:
            raise NotFound(f"no repository link {link_id}")
        return dict(link.pending)

    def repo_exports(self, link_id: int, limit: int, now_ns: int = 0) -> dict[str, Any]:
        return exports.records(self, self._repo_link(link_id), limit, now_ns)

    def repo_object(self, volume: str, slice_id: int) -> dict[str, Any]:
        """Where repo slice ``slice_id`` of ``volume`` reads from (``Q.RepoObject``)."""
        raw = self.repo_objects.get(slice_id)
        if raw is None:
            raise NotFound(f"repo slice {slice_id:x} is gone (its file changed or was removed)")
        link_id, size, etag, key = unpack_repo_object(raw)
        link = self.links.get(link_id)
        if link is None:
            raise NotFound(f"repository link {link_id} was removed")
        if link.volume != volume:
            raise NotFound(f"repo slice {slice_id:x} is not in volume {volume!r}")
        spec = self.cluster.volumes.get(volume)
        return {
            "link": link.to_dict(),
            "key": link.prefix + key,
            "etag": etag,
            "size": size,
            "block_size": spec.block_size if spec is not None else 0,
        }

    def statfs(self, volume: str) -> FsStats:
        vol = self._vol(volume)
        capacity, _reported = self.cluster.capacity()
        bsize = 4096
        overhead = self._overhead(vol)
        if capacity and overhead:  # in this volume's bytes: the datanodes' raw bytes over its overhead
            total = int(capacity / overhead)
            free = max(int((capacity - self._raw_used()) / overhead), 0)
        else:
            total = max(vol.used_bytes, 1 << 50)
            free = total - vol.used_bytes
        files = len(vol.inodes)
        max_files = MAX_INO
        return FsStats(
            bsize=bsize,
            frsize=bsize,
            blocks=total // bsize,
            bfree=free // bsize,
            bavail=free // bsize,
            files=max_files,
            ffree=max_files - files,
            favail=max_files - files,
            namemax=C.NAME_MAX,
            used_bytes=vol.used_bytes,
            used_inodes=files,
        )

    def trash(self, volume: str, limit: int, before_ns: int | None = None) -> list[TrashEntry]:
        """Unreferenced slices, oldest first."""
        vol = self._gc_vol(volume)
        out: list[TrashEntry] = []
        for rec in _TRASH.iter_unpack(vol.trash):
            if before_ns is not None and rec[2] >= before_ns:
                continue
            out.append(TrashEntry._make(rec))
            if len(out) >= limit:
                break
        return out

    def unreferenced(self, volume: str, slice_ids: tuple[int, ...]) -> Unreferenced:
        """Of ``slice_ids``, those below the floor that no file or trash entry holds."""
        vol = self._gc_vol(volume)
        floor = self.slice_floor
        left = {s for s in slice_ids if s < floor}
        if left:
            left.difference_update(rec[0] for rec in _TRASH.iter_unpack(vol.trash))
        for inode in vol.inodes.values():
            if not left:
                break
            if _kind(inode.mode) == _S_IFREG:
                left.difference_update(rec[1] for rec in _all_records(inode.data))
        return Unreferenced(floor, sorted(left))

    def repair_queue(self, volume: str, limit: int) -> list[RepairEntry]:
        """Blocks stored short, oldest first."""
        queue = self._gc_vol(volume).repairs
        return [RepairEntry(s, i, t) for (s, i), t in itertools.islice(queue.items(), limit)]

    # -- snapshots (the format lives in snapshot.py) ---------------------------------

    def snapshot(self) -> bytes:
        """The whole replicated state, msgpack then zstd; deterministic bytes."""
        from .snapshot import dump  # snapshot.py builds on this module's types

        return dump(self)

    def restore(self, data: bytes) -> None:
        from .snapshot import load

        load(self, data)
