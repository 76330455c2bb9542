"""Typed, frozen Raft messages and their msgpack encoding.

The core (``core.py``) only ever sees these classes; bytes exist only at the
edge (``encode``/``decode``), which is where untrusted input is validated:
``decode`` rejects anything malformed with :class:`cachefs.errors.ProtocolError`
so a bad peer can never put a half-formed message into a core.

Every message carries ``term`` (the sender's term, or the term it asks for in
a pre-vote), ``src`` and ``dst`` (replica ids). Node ids are small positive
ints; ``0`` means "none" (no vote, no known leader).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack  # type: ignore[import-untyped]

from cachefs.errors import ProtocolError

from . import membership
from .membership import Membership

NONE = 0  # "no node": no vote cast, no leader known


class EntryKind(IntEnum):
    NORMAL = 0  # a state machine command
    NOOP = 1  # appended by a new leader to commit entries of earlier terms
    CONFIG = 2  # a new membership (``membership.encode``), in effect once appended


@dataclass(frozen=True, slots=True)
class Entry:
    term: int
    index: int
    data: bytes = b""
    kind: EntryKind = EntryKind.NORMAL


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be on disk before a node answers anyone (Raft figure 2).

    Two flags for a replica whose disk is new (see ``core.py``):
    ``discovering``: it has not yet heard enough peers' terms to tell a new
    cluster from a lost disk, so it does nothing else (set when the storage
    is created); ``rebuilding``: it was a lost disk, so it may have forgotten
    votes and entries it promised, and it takes no part in elections until a
    leader has caught it up. On disk so that a restart does not forget them.
    """

    term: int = 0
    vote: int = NONE
    commit: int = 0
    rebuilding: bool = False
    discovering: bool = False


@dataclass(frozen=True, slots=True)
class SnapshotMeta:
    """Where a snapshot ends, and the membership in effect there (so a log
    compacted past a CONFIG entry keeps it). Snapshots written before
    membership changes carry only ``voters``."""

    index: int = 0
    term: int = 0
    voters: tuple[int, ...] = ()
    learners: tuple[int, ...] = ()
    addrs: tuple[tuple[int, str], ...] = ()

    @classmethod
    def at(cls, index: int, term: int, m: Membership) -> SnapshotMeta:
        return cls(index, term, m.voters, m.learners, m.addrs)

    @property
    def membership(self) -> Membership:
        return Membership(tuple(sorted(self.voters)), self.learners, self.addrs)


@dataclass(frozen=True, slots=True)
class Snapshot:
    meta: SnapshotMeta
    data: bytes = b""


@dataclass(frozen=True, slots=True)
class Vote:
    """RequestVote; ``pre`` marks a pre-vote, which changes nobody's term."""

    term: int
    src: int
    dst: int
    last_index: int
    last_term: int
    pre: bool = False


@dataclass(frozen=True, slots=True)
class VoteResp:
    term: int
    src: int
    dst: int
    granted: bool
    pre: bool = False


@dataclass(frozen=True, slots=True)
class Append:
    term: int
    src: int
    dst: int
    prev_index: int
    prev_term: int
    entries: tuple[Entry, ...]
    commit: int


@dataclass(frozen=True, slots=True)
class AppendResp:
    """``index``: the follower's last matching index on success, or the
    rejected ``prev_index``; on reject ``hint_index``/``hint_term`` point at
    the follower's last entry whose term is <= the leader's ``prev_term``
    (fast back-off: one round trip per term, not per entry)."""

    term: int
    src: int
    dst: int
    index: int
    reject: bool = False
    hint_index: int = 0
    hint_term: int = 0


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """``ctx`` is the leader's newest read-index request number; an answer
    with ``ctx >= n`` proves the follower still followed us after read ``n``."""

    term: int
    src: int
    dst: int
    commit: int
    ctx: int = 0


@dataclass(frozen=True, slots=True)
class HeartbeatResp:
    """``reject``: the follower's log ends at ``hint_index``, below the commit
    the heartbeat carried (``min(match, commit)``), so it lost entries it had
    acknowledged: its data directory was wiped. The leader must forget that
    match and probe again (down to a snapshot), or it never resends them."""

    term: int
    src: int
    dst: int
    ctx: int = 0
    reject: bool = False
    hint_index: int = 0


@dataclass(frozen=True, slots=True)
class InstallSnapshot:
    term: int
    src: int
    dst: int
    snapshot: Snapshot


@dataclass(frozen=True, slots=True)
class Probe:
    """"What is your term?", from a replica with an empty disk (``term`` 0).
    ``nonce`` is fresh per start-up: an answer to an earlier incarnation's
    probe, still in flight, must not count."""

    term: int
    src: int
    dst: int
    nonce: int


@dataclass(frozen=True, slots=True)
class ProbeResp:
    """The answer to a Probe: ``term`` is the sender's current term."""

    term: int
    src: int
    dst: int
    nonce: int


Message = (Vote | VoteResp | Append | AppendResp | Heartbeat | HeartbeatResp | InstallSnapshot
           | Probe | ProbeResp)

# ---------------------------------------------------------------- encoding
# A message is a msgpack array [tag, term, src, dst, *fields]; entries are
# [term, index, kind, data]; a snapshot is [index, term, voters, data,
# learners, addrs] (the last two absent before membership changes).

_TAGS: dict[type, int] = {
    Vote: 1,
    VoteResp: 2,
    Append: 3,
    AppendResp: 4,
    Heartbeat: 5,
    HeartbeatResp: 6,
    InstallSnapshot: 7,
    Probe: 8,
    ProbeResp: 9,
}


def _entry_out(e: Entry) -> list[Any]:
    return [e.term, e.index, int(e.kind), e.data]


def _snapshot_out(s: Snapshot) -> list[Any]:
    m = s.meta
    return [m.index, m.term, list(m.voters), s.data, list(m.learners), [list(a) for a in m.addrs]]


def _to_list(m: Message) -> list[Any]:
    head = [_TAGS[type(m)], m.term, m.src, m.dst]
    match m:
        case Vote():
            return [*head, m.last_index, m.last_term, m.pre]
        case VoteResp():
            return [*head, m.granted, m.pre]
        case Append():
            return [*head, m.prev_index, m.prev_term, [_entry_out(e) for e in m.entries], m.commit]
        case AppendResp():
            return [*head, m.index, m.reject, m.hint_index, m.hint_term]
        case Heartbeat():
            return [*head, m.commit, m.ctx]
        case HeartbeatResp():
            return [*head, m.ctx, m.reject, m.hint_index]
        case InstallSnapshot():
            return [*head, _snapshot_out(m.snapshot)]
        case Probe() | ProbeResp():
            return [*head, m.nonce]
    raise TypeError(f"not a raft message: {m!r}")


def encode(m: Message) -> bytes:
    return msgpack.packb(_to_list(m), use_bin_type=True)


def encode_batch(msgs: Sequence[Message]) -> bytes:
    """Several messages for one peer in one buffer (one RPC call)."""
    return msgpack.packb([_to_list(m) for m in msgs], use_bin_type=True)


def _uint(v: Any, what: str) -> int:
    if type(v) is not int or v < 0:
        raise ProtocolError(f"raft message: {what} must be a non-negative int, got {v!r}")
    return v


def _bool(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise ProtocolError(f"raft message: {what} must be a bool, got {v!r}")
    return v


def _bytes(v: Any, what: str) -> bytes:
    if type(v) is not bytes:
        raise ProtocolError(f"raft message: {what} must be bytes, got {type(v).__name__}")
    return v


def entry_from_list(raw: Any) -> Entry:
    if type(raw) is not list or len(raw) != 4:
        raise ProtocolError("raft message: an entry must be [term, index, kind, data]")
    kind = _uint(raw[2], "entry kind")
    if kind not in (EntryKind.NORMAL, EntryKind.NOOP, EntryKind.CONFIG):
        raise ProtocolError(f"raft message: unknown entry kind {kind}")
    return Entry(
        _uint(raw[0], "entry term"),
        _uint(raw[1], "entry index"),
        _bytes(raw[3], "entry data"),
        EntryKind(kind),
    )


def snapshot_meta_from(index: Any, term: Any, voters: Any, learners: Any = None,
                       addrs: Any = None) -> SnapshotMeta:
    """Raises: ProtocolError: a field of the wrong type."""
    index, term = _uint(index, "snapshot index"), _uint(term, "snapshot term")
    if learners is None and addrs is None:  # written before membership changes
        if type(voters) is not list:
            raise ProtocolError("raft message: snapshot voters must be a list")
        return SnapshotMeta(index, term, tuple(_uint(v, "voter id") for v in voters))
    return SnapshotMeta.at(index, term, membership.from_lists(voters, learners, addrs))


def snapshot_from_list(raw: Any) -> Snapshot:
    if type(raw) is not list or len(raw) not in (4, 6):
        raise ProtocolError("raft message: a snapshot must be [index, term, voters, data, "
                            "learners, addrs]")
    return Snapshot(snapshot_meta_from(raw[0], raw[1], raw[2], *raw[4:]),
                    _bytes(raw[3], "snapshot data"))


_ARITY = {1: 7, 2: 6, 3: 8, 4: 8, 5: 6, 6: 7, 7: 5, 8: 5, 9: 5}


def _from_list(raw: Any) -> Message:
    if (
        type(raw) is not list
        or not raw
        or type(raw[0]) is not int
        or _ARITY.get(raw[0]) != len(raw)
    ):
        raise ProtocolError("raft message: bad shape")
    tag = raw[0]
    term, src, dst = _uint(raw[1], "term"), _uint(raw[2], "src"), _uint(raw[3], "dst")
    if tag == 1:
        return Vote(
            term,
            src,
            dst,
            _uint(raw[4], "last_index"),
            _uint(raw[5], "last_term"),
            _bool(raw[6], "pre"),
        )
    if tag == 2:
        return VoteResp(term, src, dst, _bool(raw[4], "granted"), _bool(raw[5], "pre"))
    if tag == 3:
        if type(raw[6]) is not list:
            raise ProtocolError("raft message: entries must be a list")
        prev_index = _uint(raw[4], "prev_index")
        entries = tuple(entry_from_list(e) for e in raw[6])
        for i, e in enumerate(entries):
            if e.index != prev_index + 1 + i:
                raise ProtocolError("raft message: entries are not contiguous after prev_index")
        return Append(
            term, src, dst, prev_index, _uint(raw[5], "prev_term"), entries, _uint(raw[7], "commit")
        )
    if tag == 4:
        return AppendResp(
            term,
            src,
            dst,
            _uint(raw[4], "index"),
            _bool(raw[5], "reject"),
            _uint(raw[6], "hint_index"),
            _uint(raw[7], "hint_term"),
        )
    if tag == 5:
        return Heartbeat(term, src, dst, _uint(raw[4], "commit"), _uint(raw[5], "ctx"))
    if tag == 6:
        return HeartbeatResp(term, src, dst, _uint(raw[4], "ctx"), _bool(raw[5], "reject"),
                             _uint(raw[6], "hint_index"))
    if tag == 8:
        return Probe(term, src, dst, _uint(raw[4], "nonce"))
    if tag == 9:
        return ProbeResp(term, src, dst, _uint(raw[4], "nonce"))
    return InstallSnapshot(term, src, dst, snapshot_from_list(raw[4]))


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"raft message: undecodable msgpack ({exc})") from None


def decode(data: bytes) -> Message:
    return _from_list(_unpack(data))


def decode_batch(data: bytes) -> list[Message]:
    raw = _unpack(data)
    if type(raw) is not list:
        raise ProtocolError("raft message batch: not a list")
    return [_from_list(m) for m in raw]
