"""Hypothesis strategies for well-formed, hostile Raft messages.

Well-formed means every message survives the wire codec (it is what a peer
can really make a node step): the right types, contiguous entries. Hostile
means anything else goes: terms and indices near the real ones or at the
limits, any source and destination, entry lists of any terms, commit
indexes past anyone's log, snapshot metadata that fits nothing. Snapshot
data and entry commands are valid for the test state machine (``KV``), so
what is fuzzed is Raft, not the state machine's decoder.
"""

from __future__ import annotations

import msgpack
from hypothesis import reject
from hypothesis import strategies as st

from cachefs.errors import ProtocolError
from cachefs.metanode.raft import membership
from cachefs.metanode.raft import messages as wire
from cachefs.metanode.raft.membership import Membership
from cachefs.metanode.raft.messages import (
    Append,
    AppendResp,
    Entry,
    EntryKind,
    Heartbeat,
    HeartbeatResp,
    InstallSnapshot,
    Message,
    Probe,
    ProbeResp,
    Snapshot,
    SnapshotMeta,
    Vote,
    VoteResp,
)

from .sim import KV

HUGE = (2**31, 2**62, 2**63 - 1, 2**64 - 1)


def _near(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Mostly in ``[lo, hi]`` (where the cluster's values are), 1 in 10 at a limit."""
    return st.integers(0, 9).flatmap(
        lambda k: st.sampled_from(HUGE) if k == 0 else st.integers(lo, hi))


TERMS = _near(0, 12)
KINDS = ("vote", "vote_resp", "append", "append_resp", "heartbeat", "heartbeat_resp", "snapshot",
         "probe", "probe_resp")
INDICES = _near(0, 60)


def ids(members: tuple[int, ...]) -> st.SearchStrategy[int]:
    """Mostly members (a forged member, or a buggy one), sometimes not."""
    return st.one_of(st.sampled_from(members), st.sampled_from((0, max(members) + 1, 99)))


def command(client: int, seq: int) -> bytes:
    return msgpack.packb([f"h{client}", seq, "put", "x", seq, None])


@st.composite
def entry_list(draw: st.DrawFn, prev_index: int) -> tuple[Entry, ...]:
    n = draw(st.integers(0, 4))
    out = []
    for k in range(n):
        kind = draw(st.sampled_from((EntryKind.NORMAL, EntryKind.NOOP, EntryKind.CONFIG)))
        if kind is EntryKind.NORMAL:
            data = command(draw(st.integers(0, 3)), draw(st.integers(1, 50)))
        elif kind is EntryKind.CONFIG:  # a forged configuration, or garbage
            data = draw(st.one_of(
                st.lists(st.integers(1, 5), min_size=1, max_size=4, unique=True).map(
                    lambda v: membership.encode(Membership.of(v))),
                st.binary(max_size=8)))
        else:
            data = b""
        out.append(Entry(draw(TERMS), prev_index + 1 + k, data, kind))
    return tuple(out)


@st.composite
def snapshots(draw: st.DrawFn, members: tuple[int, ...]) -> Snapshot:
    voters = draw(st.one_of(st.just(members), st.lists(ids(members), max_size=4).map(tuple)))
    kv = KV()
    kv.data = draw(st.dictionaries(st.sampled_from("xyz"), st.integers(0, 99), max_size=3))
    return Snapshot(SnapshotMeta(draw(INDICES), draw(TERMS), voters), kv.snapshot())


@st.composite
def messages(draw: st.DrawFn, members: tuple[int, ...], dst: int | None = None,
             kinds: tuple[str, ...] = KINDS) -> Message:
    """One hostile message that the codec accepts."""
    term, src = draw(TERMS), draw(ids(members))
    to = dst if dst is not None and draw(st.integers(0, 9)) else draw(ids(members))
    kind = draw(st.sampled_from(kinds))
    m: Message
    if kind == "vote":
        m = Vote(term, src, to, draw(INDICES), draw(TERMS), draw(st.booleans()))
    elif kind == "vote_resp":
        m = VoteResp(term, src, to, draw(st.booleans()), draw(st.booleans()))
    elif kind == "append":
        prev = draw(INDICES)
        m = Append(term, src, to, prev, draw(TERMS), draw(entry_list(prev)), draw(INDICES))
    elif kind == "append_resp":
        m = AppendResp(term, src, to, draw(INDICES), draw(st.booleans()), draw(INDICES),
                       draw(TERMS))
    elif kind == "heartbeat":
        m = Heartbeat(term, src, to, draw(INDICES), draw(INDICES))
    elif kind == "heartbeat_resp":
        m = HeartbeatResp(term, src, to, draw(INDICES), draw(st.booleans()), draw(INDICES))
    elif kind == "snapshot":
        m = InstallSnapshot(term, src, to, draw(snapshots(members)))
    elif kind == "probe":
        m = Probe(term, src, to, draw(INDICES))
    else:
        m = ProbeResp(term, src, to, draw(INDICES))
    try:
        decoded = wire.decode(wire.encode(m))
    except (OverflowError, ProtocolError):
        reject()  # over the wire's integer range, or refused by the codec
    return decoded
