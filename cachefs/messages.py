"""Typed replies of the metanodes, shared by the state machine and every reader.

A reply is a frozen ``NamedTuple``: the field order written in the class is
its wire encoding (msgpack packs a tuple as an array, so the metanode sends
what its state machine returned without converting it, and an attribute
reply costs 13 integers, not 13 keys). Readers decode a reply once, at the
edge (``MetaClient`` calls the decoder its command or query names): a
malformed answer from a metanode becomes an ``IOFailure`` there, never a
half-built object deeper in.

The cache node's ``get_many`` reply (:class:`BlockBatch`) is typed here
too: the client decodes it at the same kind of edge.

Replies of the administrative calls (volume specs, the cluster map, volume
lists) stay JSON-shaped maps: the CLI prints them as they are, under keys
other tools read.
"""

from __future__ import annotations

import stat
from typing import Any, NamedTuple

from cachefs.errors import IOFailure
from cachefs.layout import Slice

_INT = frozenset({int})


def _ints(raw: Any, n: int, what: str) -> None:
    """``raw`` is a list (or tuple) of ``n`` integers, else IOFailure."""
    if not isinstance(raw, list | tuple) or len(raw) != n or not _INT.issuperset(map(type, raw)):
        raise IOFailure(f"malformed {what} from metanode: {raw!r:.200}")


class Attr(NamedTuple):
    """Inode attributes; ``version`` grows with every change of the content
    (slice write, truncate), so clients know when their page cache is stale."""

    ino: int
    mode: int  # with the S_IF* type bits
    uid: int
    gid: int
    nlink: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0
    generation: int = 0
    version: int = 0
    # st_blocks (512-byte units): the slices its records hold, each in 4 KiB
    # blocks (``Inode.blocks``; the bytes quotas and statfs count), not its
    # size, so du is right and cp and tar look for a sparse file's holes
    blocks: int = 0

    @classmethod
    def from_wire(cls, raw: Any) -> Attr:
        if isinstance(raw, list | tuple) and len(raw) == 12:  # a metanode from before ``blocks``
            _ints(raw, 12, "attributes")
            return cls._make((*raw, (raw[5] + 511) // 512))
        _ints(raw, 13, "attributes")
        return cls._make(raw)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class Renamed(NamedTuple):
    """A rename's answer: the moved inode's attributes and its old and new
    directories', after the move. None for an exchange, and for a rename
    onto another link of the same inode (it moves nothing)."""

    attr: Attr
    parent: Attr
    new_parent: Attr

    @classmethod
    def from_wire(cls, raw: Any) -> Renamed | None:
        if raw is None:
            return None
        if not isinstance(raw, list | tuple) or len(raw) != 3:
            raise IOFailure(f"malformed rename answer from metanode: {raw!r:.200}")
        return cls(*map(Attr.from_wire, raw))


class DirEntry(NamedTuple):
    """One ``readdir`` row: pass ``cookie`` back to continue after this entry."""

    name: bytes
    attr: Attr
    cookie: int

    @classmethod
    def from_wire(cls, raw: Any) -> DirEntry:
        if not isinstance(raw, list | tuple) or len(raw) != 3:
            raise IOFailure(f"malformed directory entry from metanode: {raw!r:.200}")
        name, attr, cookie = raw
        if type(name) is not bytes or type(cookie) is not int:
            raise IOFailure(f"malformed directory entry from metanode: {raw!r:.200}")
        return cls(name, Attr.from_wire(attr), cookie)


class FsStats(NamedTuple):
    """``statfs`` of a volume: the statvfs fields, then the volume's own usage."""

    bsize: int
    frsize: int
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    favail: int
    namemax: int
    used_bytes: int
    used_inodes: int

    @classmethod
    def from_wire(cls, raw: Any) -> FsStats:
        _ints(raw, 11, "statfs")
        return cls._make(raw)


class Usage(NamedTuple):
    """A directory subtree's bytes and inodes (every link counts), and its quota."""

    bytes: int
    inodes: int
    max_bytes: int | None
    max_inodes: int | None

    @classmethod
    def from_wire(cls, raw: Any) -> Usage:
        if (
            not isinstance(raw, list | tuple)
            or len(raw) != 4
            or not all(type(v) is int for v in raw[:2])
            or not all(v is None or type(v) is int for v in raw[2:])
        ):
            raise IOFailure(f"malformed usage from metanode: {raw!r:.200}")
        return cls._make(raw)


class MountInfo(NamedTuple):
    """A new client session on a volume; ``policy`` is the volume's spec as
    in the cluster map."""

    root: int
    session: str
    policy: dict[str, Any]

    @classmethod
    def from_wire(cls, raw: Any) -> MountInfo:
        if (
            not isinstance(raw, list | tuple)
            or len(raw) != 3
            or type(raw[0]) is not int
            or type(raw[1]) is not str
            or not isinstance(raw[2], dict)
        ):
            raise IOFailure(f"malformed mount info from metanode: {raw!r:.200}")
        return cls._make(raw)


class TrashEntry(NamedTuple):
    """A slice no file references any more, waiting for the garbage collector."""

    slice_id: int
    size: int
    deleted_ns: int

    @classmethod
    def from_wire(cls, raw: Any) -> TrashEntry:
        _ints(raw, 3, "trash entry")
        return cls._make(raw)


# -- leases (metanode/leases.py, client/leases.py) ---------------------------------------


def _int_tuple(raw: Any, what: str) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple) or not _INT.issuperset(map(type, raw)):
        raise IOFailure(f"malformed {what} from metanode: {raw!r:.200}")
    return tuple(raw)


class Grant(NamedTuple):
    """Leases granted with a reply: on ``inos``, for ``ms`` milliseconds
    counted from when the request was sent, by the leader of Raft ``term``."""

    term: int
    ms: int
    inos: tuple[int, ...]

    @classmethod
    def from_wire(cls, raw: Any) -> Grant:
        if not isinstance(raw, list | tuple) or len(raw) != 3:
            raise IOFailure(f"malformed lease grant from metanode: {raw!r:.200}")
        term, ms, inos = raw
        if type(term) is not int or type(ms) is not int:
            raise IOFailure(f"malformed lease grant from metanode: {raw!r:.200}")
        return cls(term, ms, _int_tuple(inos, "leased inodes"))


class LeasedAttr(NamedTuple):
    """An inode's attributes and the leases that came with them."""

    attr: Attr
    grant: Grant

    @classmethod
    def from_wire(cls, raw: Any) -> LeasedAttr:
        if not isinstance(raw, list | tuple) or len(raw) != 2:
            raise IOFailure(f"malformed leased attributes from metanode: {raw!r:.200}")
        return cls(Attr.from_wire(raw[0]), Grant.from_wire(raw[1]))


class Created(NamedTuple):
    """A create's answer with a lease on the new file (``MetaClient.create``):
    its attributes, its directory's (None: removed meanwhile), and whether
    it has no extended attributes, all as of the grant."""

    attr: Attr
    parent: Attr | None
    bare: bool
    grant: Grant

    @classmethod
    def from_wire(cls, raw: Any) -> Created:
        if not isinstance(raw, list | tuple) or len(raw) != 4 or type(raw[2]) is not bool:
            raise IOFailure(f"malformed create answer from metanode: {raw!r:.200}")
        parent = None if raw[1] is None else Attr.from_wire(raw[1])
        return cls(Attr.from_wire(raw[0]), parent, raw[2], Grant.from_wire(raw[3]))


class LoadedEntry(NamedTuple):
    """One entry of a directory load: ``slices`` is chunk 0's slice list for
    a small regular file, else None."""

    name: bytes
    attr: Attr
    cookie: int
    slices: list[Slice] | None

    @classmethod
    def from_wire(cls, raw: Any) -> LoadedEntry:
        if not isinstance(raw, list | tuple) or len(raw) != 4:
            raise IOFailure(f"malformed directory entry from metanode: {raw!r:.200}")
        name, attr, cookie, sl = raw
        if type(name) is not bytes or type(cookie) is not int:
            raise IOFailure(f"malformed directory entry from metanode: {raw!r:.200}")
        return cls(name, Attr.from_wire(attr), cookie, None if sl is None else slices(sl))


class DirLoad(NamedTuple):
    """A page of a directory with everything its entries' opens need, and
    the leases on the directory and the entries (``LoadDir``)."""

    attr: Attr
    entries: list[LoadedEntry]
    more: bool
    grant: Grant

    @classmethod
    def from_wire(cls, raw: Any) -> DirLoad:
        if not isinstance(raw, list | tuple) or len(raw) != 4 or type(raw[2]) is not bool:
            raise IOFailure(f"malformed directory load from metanode: {raw!r:.200}")
        attr, entries, more, grant = raw
        if not isinstance(entries, list | tuple):
            raise IOFailure(f"malformed directory load from metanode: {raw!r:.200}")
        return cls(
            Attr.from_wire(attr), [LoadedEntry.from_wire(e) for e in entries], more,
            Grant.from_wire(grant),
        )


class LeaseNews(NamedTuple):
    """A lease poll's answer: the leader's term and lease length, and
    ``(revocation id, ino)`` of every lease of the session being revoked."""

    term: int
    ms: int
    revoke: list[tuple[int, int]]

    @classmethod
    def from_wire(cls, raw: Any) -> LeaseNews:
        if not isinstance(raw, list | tuple) or len(raw) != 3:
            raise IOFailure(f"malformed lease poll reply from metanode: {raw!r:.200}")
        term, ms, revoke = raw
        if type(term) is not int or type(ms) is not int or not isinstance(revoke, list | tuple):
            raise IOFailure(f"malformed lease poll reply from metanode: {raw!r:.200}")
        for row in revoke:
            _ints(row, 2, "revocation")
        return cls(term, ms, [(r[0], r[1]) for r in revoke])


# -- decoders for replies without a class of their own ------------------------------


def _listed(decode: Any, what: str) -> Any:
    def decode_list(raw: Any) -> list[Any]:
        if not isinstance(raw, list | tuple):
            raise IOFailure(f"metanode sent {what} as {type(raw).__name__}")
        return [decode(row) for row in raw]

    decode_list.__name__ = f"list_of_{what.replace(' ', '_')}"
    return decode_list


class RepairEntry(NamedTuple):
    """A block stored with fewer than all its shards, waiting for the repair service."""

    slice_id: int
    index: int
    queued_ns: int

    @classmethod
    def from_wire(cls, raw: Any) -> RepairEntry:
        _ints(raw, 3, "repair entry")
        return cls._make(raw)


class Unreferenced(NamedTuple):
    """Slices below the commit floor that nothing references: their blocks are garbage."""

    floor: int
    slice_ids: list[int]

    @classmethod
    def from_wire(cls, raw: Any) -> Unreferenced:
        if (not isinstance(raw, list | tuple) or len(raw) != 2 or type(raw[0]) is not int
                or not isinstance(raw[1], list | tuple) or not all(type(v) is int for v in raw[1])):
            raise IOFailure("malformed unreferenced slices from metanode")
        return cls(raw[0], list(raw[1]))


dir_entries = _listed(DirEntry.from_wire, "directory entries")
trash_entries = _listed(TrashEntry.from_wire, "trash entries")
repair_entries = _listed(RepairEntry.from_wire, "repair entries")


def slices(raw: Any) -> list[Slice]:
    """A chunk's slice list, ``[slice_id, pos, length, offset]`` each, in commit order."""
    if not isinstance(raw, list | tuple):
        raise IOFailure(f"metanode sent a slice list as {type(raw).__name__}")
    out = []
    for row in raw:
        _ints(row, 4, "slice")
        try:
            out.append(Slice.from_wire(row))
        except ValueError as exc:
            raise IOFailure(f"malformed slice from metanode: {exc}") from None
    return out


def nothing(raw: Any) -> None:
    if raw is not None:
        raise IOFailure(f"metanode answered {type(raw).__name__} where it owes nothing")


def integer(raw: Any) -> int:
    if type(raw) is not int:
        raise IOFailure(f"metanode sent {type(raw).__name__} for an integer")
    return raw


def boolean(raw: Any) -> bool:
    if type(raw) is not bool:
        raise IOFailure(f"metanode sent {type(raw).__name__} for a boolean")
    return raw


def blob(raw: Any) -> bytes:
    if type(raw) is not bytes:
        raise IOFailure(f"metanode sent {type(raw).__name__} for bytes")
    return raw


def blobs(raw: Any) -> list[bytes]:
    if not isinstance(raw, list | tuple) or not all(type(v) is bytes for v in raw):
        raise IOFailure(f"metanode sent {type(raw).__name__} for a list of bytes")
    return list(raw)


def strings(raw: Any) -> list[str]:
    if not isinstance(raw, list | tuple) or not all(type(v) is str for v in raw):
        raise IOFailure(f"metanode sent {type(raw).__name__} for a list of strings")
    return list(raw)


def mapping(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise IOFailure(f"metanode sent {type(raw).__name__} for a map")
    return raw


def mapping_list(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list | tuple) or not all(isinstance(v, dict) for v in raw):
        raise IOFailure(f"metanode sent {type(raw).__name__} for a list of maps")
    return list(raw)


MANY_MISS = -1  # get_many: the node does not hold the block (the client reads it the usual way)
MANY_NOT_SERVED = -2  # get_many: over the reply's byte budget; ask again
# Bytes of blocks per get_many reply: far under the wire's frame (64 MiB) and
# outbox (32 MiB) limits; 64 blocks of 128 KiB fit, two of 4 MiB. A client's
# receive scratch (cachefs.buffers.ScratchPool) is this large.
GET_MANY_BYTES = 8 << 20


class BlockBatch(NamedTuple):
    """A cache node's ``get_many`` answer: per key asked, in order, the
    block's size if it is in the payload (the served blocks joined in key
    order), else :data:`MANY_MISS` or :data:`MANY_NOT_SERVED`."""

    sizes: tuple[int, ...]

    @classmethod
    def from_wire(cls, raw: Any, asked: int, payload_len: int) -> BlockBatch:
        """Check a reply to a call that asked ``asked`` keys and brought
        ``payload_len`` bytes of payload.

        Raises:
            IOFailure: a malformed reply (wrong count, a bad size, sizes that
                do not add up to the payload).
        """
        sizes = raw[0] if isinstance(raw, list | tuple) and len(raw) == 1 else None
        if (
            not isinstance(sizes, list | tuple)
            or len(sizes) != asked
            or not _INT.issuperset(map(type, sizes))
            or any(s < MANY_NOT_SERVED for s in sizes)
            or sum(s for s in sizes if s >= 0) != payload_len
        ):
            raise IOFailure(f"malformed get_many reply from cache node: {raw!r:.200}")
        return cls(tuple(sizes))

    def split(self, payload: bytes | bytearray | memoryview) -> list[memoryview | int]:
        """Per key: a view of its block in ``payload``, or its marker."""
        view = memoryview(payload) if payload is not None else memoryview(b"")
        out: list[memoryview | int] = []
        pos = 0
        for size in self.sizes:
            if size < 0:
                out.append(size)
            else:
                out.append(view[pos : pos + size])
                pos += size
        return out
