"""Which sessions hold which inodes open: leader soft state, not log entries."""

from __future__ import annotations

from .namespace import MetaState


class OpenTable:
    """Which sessions hold which inodes open: soft state on the leader only.

    ``open`` and ``release`` are not log entries (a data loader opening
    thousands of small files would pay a replicated fsync for each); the
    leader counts them here, and the promise "an unlinked file stays readable
    while some session has it open" is kept like this:

    - Every command that can drop a file's last link (unlink, rename over a
      target) is stamped by the leader with the inode it expects to drop and
      ``keep`` = whether that inode is open. The apply keeps the inode as an
      orphan when ``keep`` is set or when it dropped another inode than
      expected, so every replica decides the same whatever the leader knew.
    - An open that arrives while a drop stamped "not open" for that inode is
      in flight waits for it, then checks the inode still exists (if not, the
      unlink came first: ENOENT). Likewise for an in-flight purge.
    - A new leader (any change of term) knows no session's opens. Clients
      re-announce their open set with every session heartbeat (5 s); a
      session counts as *known* once it announced to this leader (or was
      mounted through it). While any session of a volume is unknown, every
      drop in that volume is stamped ``keep`` and no orphan is purged: an
      unknown session may hold anything. A session that never announces
      expires (``session_timeout``), which makes the volume settled again.
    - An announcement is merged (union), never trusted to remove: it may be
      older than an open that reached the leader first. A release that
      reaches the leader before the session is known is remembered, so a
      stale announcement cannot resurrect it. Once known, open/release RPCs
      keep the table exact (the client sends open on its 0->1 and release
      on its 1->0 transition of an inode, one at a time per inode).
    - Orphans are purged by a replicated ``PurgeOrphans`` that the leader
      proposes when the last open of an orphan goes, when a holder's session
      ends (unmount, or expiry of a crashed client), or when the volume
      becomes settled after a failover.

    A leader that loses leadership and regains it later is in a new term and
    starts from nothing again, so what it missed meanwhile cannot mislead it.
    A client that crashes stops heartbeating; its session expires after
    ``session_timeout`` (``CloseSession`` in the log), its opens are dropped
    here and its orphans purged. Errors only ever err on the side of keeping:
    a release lost for good (the client gave up retrying) leaves the file
    counted as open until the session ends, never the other way round.
    """

    def __init__(self) -> None:
        self.by_session: dict[str, set[int]] = {}
        self.volume_of: dict[str, str] = {}  # session -> volume, for sessions in by_session
        self.holders: dict[tuple[str, int], int] = {}  # (volume, ino) -> sessions
        self.known: set[str] = set()
        self._released: dict[str, set[int]] = {}  # by sessions not yet known
        # (session, ino) -> wall-clock ns of the open (0: announced, so unknown)
        self.since: dict[tuple[str, int], int] = {}

    def reset(self) -> None:
        self.by_session.clear()
        self.volume_of.clear()
        self.holders.clear()
        self.known.clear()
        self._released.clear()
        self.since.clear()

    def open(self, volume: str, session: str, ino: int, now_ns: int = 0) -> None:
        inos = self.by_session.setdefault(session, set())
        self.volume_of[session] = volume
        if ino not in inos:
            inos.add(ino)
            self.since[(session, ino)] = now_ns
            key = (volume, ino)
            self.holders[key] = self.holders.get(key, 0) + 1
        released = self._released.get(session)
        if released is not None:
            released.discard(ino)

    def release(self, volume: str, session: str, ino: int) -> bool:
        """True if no session holds ``ino`` any more."""
        inos = self.by_session.get(session)
        if inos is not None and ino in inos:
            inos.discard(ino)
            self.since.pop((session, ino), None)
            self._drop_holder(volume, ino)
        if session not in self.known:
            self._released.setdefault(session, set()).add(ino)
        return not self.is_open(volume, ino)

    def _drop_holder(self, volume: str, ino: int) -> None:
        key = (volume, ino)
        left = self.holders[key] - 1
        if left:
            self.holders[key] = left
        else:
            del self.holders[key]

    def announce(self, volume: str, session: str, inos: list[int]) -> None:
        """A session's open set, sent with its heartbeat; see the class docstring."""
        if session in self.known:
            return
        released = self._released.pop(session, set())
        for ino in inos:
            if ino not in released:
                self.open(volume, session, ino)
        self.known.add(session)

    def end_session(self, session: str) -> None:
        volume = self.volume_of.pop(session, "")
        for ino in self.by_session.pop(session, ()):
            self.since.pop((session, ino), None)
            self._drop_holder(volume, ino)
        self.known.discard(session)
        self._released.pop(session, None)

    def oldest_open_ns(self, volume: str) -> int | None:
        """When the oldest open on ``volume`` began (0 if announced), or None."""
        times = [
            self.since[(sid, ino)]
            for sid, inos in self.by_session.items()
            if self.volume_of.get(sid) == volume
            for ino in inos
        ]
        return min(times, default=None)

    def is_open(self, volume: str, ino: int) -> bool:
        return (volume, ino) in self.holders

    def settled(self, state: MetaState, volume: str) -> bool:
        """Whether this leader knows the opens of every session on ``volume``."""
        known = self.known
        return all(s.volume != volume or sid in known for sid, s in state.sessions.items())

    def keep(self, state: MetaState, volume: str, expect: int) -> bool:
        """The stamp for a command expected to drop ``expect`` (0: unknown)."""
        if not expect or not self.settled(state, volume):
            return True
        return self.is_open(volume, expect)
