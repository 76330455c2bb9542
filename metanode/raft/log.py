"""The in-memory Raft log: a compacted prefix, stable entries, unstable entries.

Theory of operation::

      snapshot        stable (on disk)   being written        not handed out yet
    [ .. snap_index ] [ first .. stable ] [ .. in_progress ] [ in_progress+1 .. last_index ]
                              applied <= committed <= last_index

``entries[k]`` has index ``snap_index + 1 + k``. The driver is handed the
entries after ``in_progress`` (a Ready), and says when they are on disk
(``stable_to``); a driver that writes asynchronously has some in between. A
conflicting append cuts the tail and pulls ``stable`` and ``in_progress``
back, so a rewritten suffix is handed to the driver again (the WAL replays
"entry i" as "cut after i-1, then append", see ``storage.py``).
``pending_snapshot`` is a snapshot received from a leader that the driver has
not persisted yet; while it is set, the log starts after it.

Invariants (checked by the simulation tests, kept by every method here):
``snap_index <= applied <= committed <= last_index``,
``stable <= in_progress <= last_index``, entry indices are contiguous.
``committed`` may run ahead of ``stable``: on a follower (the leader's
commit index; the driver persists before it applies), and on a leader
whose own write is still under way when its followers' acknowledgements
already make a quorum.
"""

from __future__ import annotations

from .messages import Entry, Snapshot


class RaftLog:
    __slots__ = (
        "snap_index",
        "snap_term",
        "entries",
        "stable",
        "in_progress",
        "committed",
        "applied",
        "pending_snapshot",
    )

    def __init__(
        self,
        snap_index: int = 0,
        snap_term: int = 0,
        entries: list[Entry] | None = None,
        committed: int = 0,
    ) -> None:
        self.snap_index = snap_index
        self.snap_term = snap_term
        self.entries: list[Entry] = list(entries or ())
        for k, e in enumerate(self.entries):
            if e.index != snap_index + 1 + k:
                raise ValueError(f"log entries not contiguous at {e.index}")
        self.stable = self.last_index()  # what we were built from is on disk
        self.in_progress = self.stable
        self.committed = min(max(committed, snap_index), self.last_index())
        self.applied = snap_index
        self.pending_snapshot: Snapshot | None = None

    # ------------------------------------------------------------- queries
    def first_index(self) -> int:
        return self.snap_index + 1

    def last_index(self) -> int:
        return self.snap_index + len(self.entries)

    def term(self, index: int) -> int | None:
        """Term of ``index``; None when compacted away or beyond the end."""
        off = index - self.snap_index
        if off == 0:
            return self.snap_term
        if off < 0 or off > len(self.entries):
            return None
        return self.entries[off - 1].term

    def last_term(self) -> int:
        return self.entries[-1].term if self.entries else self.snap_term

    def match_term(self, index: int, term: int) -> bool:
        return self.term(index) == term

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Raft 5.4.1: may a candidate with this log get our vote?"""
        mine = self.last_term()
        return last_term > mine or (last_term == mine and last_index >= self.last_index())

    def slice(self, lo: int, hi: int, max_bytes: int) -> list[Entry]:
        """Entries ``[lo, hi)``, at least one, then up to ``max_bytes`` of data."""
        base = self.snap_index + 1
        out: list[Entry] = []
        size = 0
        for e in self.entries[lo - base : hi - base]:
            size += len(e.data)
            if out and size > max_bytes:
                break
            out.append(e)
        return out

    def unstable_entries(self) -> list[Entry]:
        """Entries not handed to the driver yet (``in_progress`` onwards)."""
        return self.entries[self.in_progress - self.snap_index :]

    def committed_to_apply(self) -> list[Entry]:
        """Committed entries not applied yet: on a quorum's disks, though a
        leader's own write of them may still be under way (``in_progress``)."""
        base = self.snap_index + 1
        return self.entries[self.applied + 1 - base : self.committed + 1 - base]

    def find_conflict(self, entries: tuple[Entry, ...] | list[Entry]) -> int:
        """Index of the first entry whose term differs from ours (or that we
        lack); 0 if we already hold them all."""
        for e in entries:
            if not self.match_term(e.index, e.term):
                return e.index
        return 0

    def find_conflict_by_term(self, index: int, term: int) -> tuple[int, int]:
        """Largest ``i <= index`` with ``term(i) <= term``, and that term.

        Used on both sides of a rejected append: the follower's hint and the
        leader's next probe skip a whole term of mismatching entries at once.
        """
        index = min(index, self.last_index())
        while index > self.snap_index:
            t = self.term(index)
            assert t is not None
            if t <= term:
                return index, t
            index -= 1
        return index, (self.snap_term if index == self.snap_index else 0)

    # ----------------------------------------------------------- mutations
    def append(self, entries: list[Entry] | tuple[Entry, ...]) -> None:
        """Append, cutting our tail after ``entries[0].index - 1`` first."""
        if not entries:
            return
        after = entries[0].index - 1
        if after < self.committed:
            raise AssertionError(f"append after {after} would cut committed {self.committed}")
        if after > self.last_index():
            raise AssertionError(f"append after {after} leaves a gap after {self.last_index()}")
        del self.entries[after - self.snap_index :]
        self.entries.extend(entries)
        self.stable = min(self.stable, after)
        self.in_progress = min(self.in_progress, after)

    def maybe_append(
        self, prev_index: int, prev_term: int, leader_commit: int, entries: tuple[Entry, ...]
    ) -> int | None:
        """The follower side of AppendEntries; the last new index, or None on
        a mismatch at ``prev_index``."""
        if not self.match_term(prev_index, prev_term):
            return None
        last_new = prev_index + len(entries)
        conflict = self.find_conflict(entries)
        if conflict:
            if conflict <= self.committed:
                raise AssertionError(f"entry {conflict} conflicts with committed {self.committed}")
            self.append(entries[conflict - prev_index - 1 :])
        self.commit_to(min(leader_commit, last_new))
        return last_new

    def commit_to(self, index: int) -> None:
        if index > self.committed:
            if index > self.last_index():
                raise AssertionError(f"commit {index} beyond last index {self.last_index()}")
            self.committed = index

    def maybe_commit(self, index: int, term: int) -> bool:
        """Commit ``index`` if it is newer and from ``term`` (Raft 5.4.2)."""
        if index > self.committed and self.term(index) == term:
            self.committed = index
            return True
        return False

    def in_progress_to(self, index: int) -> None:
        """The driver took the entries up to ``index`` to write."""
        self.in_progress = max(self.in_progress, index)

    def stable_to(self, index: int, term: int) -> None:
        """The driver persisted entries up to ``(index, term)``; ignored if the
        tail was rewritten since (the new one is still unstable)."""
        if index > self.stable and self.term(index) == term:
            self.stable = index

    def applied_to(self, index: int) -> None:
        if index < self.applied or index > self.committed:
            raise AssertionError(f"applied {index} outside [{self.applied}, {self.committed}]")
        self.applied = index

    def restore(self, snapshot: Snapshot) -> None:
        """Replace the whole log with a snapshot from the leader."""
        self.snap_index = snapshot.meta.index
        self.snap_term = snapshot.meta.term
        self.entries = []
        self.stable = self.in_progress = self.snap_index
        self.committed = self.snap_index
        self.applied = self.snap_index  # the driver restores the state machine first
        self.pending_snapshot = snapshot

    def snapshot_persisted(self, index: int) -> None:
        if self.pending_snapshot is not None and self.pending_snapshot.meta.index == index:
            self.pending_snapshot = None

    def compact(self, index: int) -> None:
        """Drop entries up to ``index`` (already in a persisted snapshot)."""
        if index <= self.snap_index:
            return
        if index > self.applied or index > self.stable:
            raise AssertionError(
                f"compact {index} beyond applied {self.applied}/stable {self.stable}"
            )
        term = self.term(index)
        assert term is not None
        del self.entries[: index - self.snap_index]
        self.snap_index, self.snap_term = index, term
