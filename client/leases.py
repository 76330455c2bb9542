"""The client's half of metadata leases: what this session may answer from memory.

Theory of operation
-------------------
The leader grants a session leases on inodes with the answers of
``LeaseLookup``, ``LeaseGetAttr``, ``LeaseOpen`` and ``LoadDir``, and revokes
them through the session's poll (``LeasePoll``) before any other session's
change to them applies (``metanode/leases.py``). While a lease is valid,
what this session learned about the inode under it is current: its
attributes, its extended attributes, and for a directory the names it
learned (all of them once ``complete``: then a name not there does not
exist). :class:`LeaseCache` is that knowledge, sans-IO (time enters as
``now``, ``time.monotonic`` of this client); :class:`~.session.Session` does
the requests and runs the poll, the FUSE front end gives the kernel long
timeouts and invalidates the kernel's caches when a lease is lost.

Time. A lease lasts the grant's ``ms`` from when the request that carried it
was *sent*: the leader counts from when it read the state, later, so this
copy lapses first. A poll answered renews every lease installed before the
poll was sent (the leader renewed all it still held when the poll arrived,
and the answer names every lease it is revoking, which are dropped first).
``MARGIN`` of the term is kept back for unequal clock rates.

Stale answers. An answer is installed only if nothing about the inode
changed here since its request was sent: every drop (revocation, expiry of
the leadership term, this session's own mutation) bumps a stamp, and a
request carries the stamp of its start (:meth:`ticket`); an answer whose
inode was stamped later is not installed (the leader may believe we hold a
lease we refused: that only costs it a revocation we acknowledge at once).

Own mutations. The session keeps its leases on what it changes itself
(:meth:`begin_mutation`): it tells the leader which ones (``kept``), so the
leader revokes them from everyone else but not from us, and after the reply
it forgets what the change made stale (:meth:`end_mutation`): the
attributes of every inode involved and the names it changed. A reply that
is the changed inode's attributes (a slice commit, a setattr) is kept
instead, under the lease, when no other own change of that inode overlapped
this one (which of two concurrent changes applied last is unknown): the
lease was held throughout (no grant is taken while the change is in
flight, and a drop ends the lease), so no one else's change came after it.
So is the name a create or link made in a leased directory: a stat of a
file this mount just wrote is answered from memory. The kernel
updates its own caches after its own changes. The names stay in the
directory's ``kernel_names``: the kernel may still cache them (a rename
moves a dentry with its timeout), so they are invalidated when the
directory's lease goes.

Opens. A file opened while its lease is valid is not announced to the
leader (``unannounced``): the lease guarantees no one can unlink or rewrite
it without revoking first. When such a lease is lost, the open is reported
(``report``) with the message that gives the lease up: the ack, the drop,
or the mutation; a lease lost to time is covered by the leader, which
counts an unacknowledged lapsed lease as possibly open.

Failover. A reply of a newer Raft term means a new leader: every lease of an
older term is dropped (and the kernel's caches with it), and no grant of an
older term is taken after that. The next poll names the newest term this
session knows (``held_term``): it holds no lease older than that, now or
while the poll is in flight and retried, which lets the new leader stop
waiting for old leases to lapse.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from cachefs.errors import (
    CrossDevice,
    FileTooLarge,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NoData,
    NoSpace,
    NotADirectory,
    NotEmpty,
    NotPermitted,
    NotSupported,
    PermissionDenied,
    QuotaExceeded,
    Range,
    ReadOnly,
    TooManyLinks,
)
from cachefs.messages import Attr, Grant, LeaseNews

# What the namespace answers when its apply refuses a change, having changed
# nothing and contradicting nothing we know (a timeout, a lost leader or an
# I/O error leaves the outcome unknown; ENOENT and EEXIST say a name is not
# what we thought: what we knew of it goes).
REJECTIONS = (NotEmpty, NotADirectory, IsADirectory, NameTooLong, InvalidArgument, PermissionDenied,
              NotPermitted, NoSpace, QuotaExceeded, FileTooLarge, CrossDevice, TooManyLinks, NoData,
              Range, ReadOnly, NotSupported)  # fmt: skip

MARGIN = 0.1  # of the lease term, kept back for clock rates and scheduling
MAX_LEASES = 1 << 20  # leases one session keeps; the least recently used go first


@dataclass(slots=True)
class Lease:
    """What this session knows about one inode under a lease."""

    since: float  # when the request that granted it was sent
    installed: float  # when the grant arrived (a poll sent later renews it)
    attr: Attr | None = None
    entries: dict[bytes, int] = field(default_factory=dict)  # a directory's names -> inode
    complete: bool = False  # ``entries`` is the whole directory
    # names the kernel may cache under this lease (long entry timeouts):
    # invalidated when the lease goes
    kernel_names: set[bytes] = field(default_factory=set)
    # extended attributes read under it: name -> value (None: there is none);
    # ``bare``: the inode has none at all (known from its create)
    xattrs: dict[bytes, bytes | None] = field(default_factory=dict)
    bare: bool = False
    # a directory's listing may be kept by the kernel: its cache was emptied
    # after this lease began (see CacheFS.dir_cacheable)
    kernel_listing: bool = False


class Ticket(NamedTuple):
    """Taken when a request is sent: what its answer may be installed over."""

    stamp: int
    sent: float


class OwnChange(NamedTuple):
    """An own mutation in flight (:meth:`LeaseCache.begin_mutation`)."""

    kept: tuple[int, ...]  # the inodes whose leases we keep
    opens: tuple[int, ...]  # which of them we have open unannounced
    began: tuple[int, ...]  # each one's count of own changes begun or ended, after ours began


class PollState(NamedTuple):
    """What the next poll tells the leader (see :meth:`LeaseCache.outgoing`)."""

    acks: tuple[int, ...]
    drops: tuple[int, ...]
    opens: tuple[int, ...]
    held_term: int
    lost: tuple[tuple[int, tuple[bytes, ...]], ...]  # kernel caches to drop first: (ino, names)


class LeaseCache:
    """This session's leases (see the module docstring)."""

    def __init__(self, max_leases: int = MAX_LEASES) -> None:
        self.term = 0  # Raft term of the leader whose leases we hold
        self.length = 0.0  # seconds a lease lasts (from the grants)
        self.max_leases = max_leases
        self._held: OrderedDict[int, Lease] = OrderedDict()
        self._stamp = 0
        self._changed: dict[int, int] = {}  # ino -> stamp of its last change here
        self._all_changed = 0  # stamp of the last drop of everything
        self._busy: dict[int, int] = {}  # ino -> own mutations in flight
        self._own: dict[int, int] = {}  # ino -> own mutations begun or ended (while any is in flight)
        self._tickets: dict[int, int] = {}  # stamps of requests in flight -> how many
        self.renewed = float("-inf")  # when the last answered poll was sent
        self.unannounced: set[int] = set()  # opened under a lease, the leader not told
        self._acks: set[int] = set()
        self._drops: set[int] = set()
        self._report: set[int] = set()  # opens to report with the next message
        self._lost: dict[int, set[bytes]] = {}  # ino -> names, for the front end to invalidate
        # invalidations_left: drops of kernel caches the poll went on without
        # waiting for (the front end's INVALIDATE_WAIT)
        self.stats = {"hits": 0, "grants": 0, "revoked": 0, "lapsed": 0, "invalidations_left": 0}

    def __len__(self) -> int:
        return len(self._held)

    # -- validity ------------------------------------------------------------------

    def remaining(self, lease: Lease, now: float) -> float:
        """Seconds ``lease`` stays valid (<= 0: lapsed)."""
        start = lease.since if lease.installed > self.renewed else max(lease.since, self.renewed)
        return start + self.length * (1 - MARGIN) - now

    def get(self, ino: int, now: float) -> Lease | None:
        """The valid lease on ``ino``, or None."""
        lease = self._held.get(ino)
        if lease is None:
            return None
        if self.remaining(lease, now) <= 0:
            self.stats["lapsed"] += 1
            self._forget(ino)  # no revocation: no ack owed, the kernel's timeouts ended too
            return None
        self._held.move_to_end(ino)
        return lease

    def held_term(self) -> int:
        """The newest leader term known: no lease held, or taken from now
        on, is older. (Not 0 when nothing is held: a poll built so may
        reach a new leader after this session took leases of the old one.)"""
        return self.term

    # -- answers --------------------------------------------------------------------

    def ticket(self, now: float) -> Ticket:
        """Call before sending a request whose answer may be installed;
        :meth:`done` when it has been handled."""
        t = Ticket(self._stamp, now)
        self._tickets[t.stamp] = self._tickets.get(t.stamp, 0) + 1
        return t

    def done(self, ticket: Ticket) -> None:
        left = self._tickets[ticket.stamp] - 1
        if left:
            self._tickets[ticket.stamp] = left
        else:
            del self._tickets[ticket.stamp]
            if len(self._changed) > 4096:
                oldest = min(self._tickets, default=self._stamp)
                self._changed = {i: s for i, s in self._changed.items() if s > oldest}

    def fresh(self, ticket: Ticket, ino: int) -> bool:
        """Nothing about ``ino`` changed here since ``ticket`` was taken."""
        return (
            self._changed.get(ino, 0) <= ticket.stamp
            and self._all_changed <= ticket.stamp
            and ino not in self._busy
        )

    def accept(self, ticket: Ticket, grant: Grant, now: float) -> dict[int, Lease]:
        """Install the leases of ``grant`` that are fresh; their leases, to
        fill with what the answer said. A newer term drops every older lease."""
        if grant.term < self.term or not grant.ms:
            return {}
        if grant.term > self.term:
            self.drop_all()
            self.term = grant.term
        self.length = grant.ms / 1000
        out = {}
        for ino in grant.inos:
            if not self.fresh(ticket, ino):
                continue
            lease = self._held.get(ino)
            if lease is None or self.remaining(lease, now) <= 0:
                lease = self._held[ino] = Lease(ticket.sent, now)
            else:
                lease.since = max(lease.since, ticket.sent)
                lease.installed = now
                self._held.move_to_end(ino)
            out[ino] = lease
        self.stats["grants"] += len(out)
        while len(self._held) > self.max_leases:
            ino = next(iter(self._held))
            self._drop(ino)
            self._drops.add(ino)
        return out

    # -- losing leases ----------------------------------------------------------------

    def _bump(self, ino: int) -> None:
        self._stamp += 1
        self._changed[ino] = self._stamp

    def _forget(self, ino: int) -> None:
        del self._held[ino]
        self._bump(ino)
        if ino in self.unannounced:
            self.unannounced.discard(ino)
            self._report.add(ino)

    def _drop(self, ino: int) -> None:
        """Give up the lease on ``ino`` (the kernel's caches of it go too)."""
        lease = self._held.get(ino)
        if lease is not None:
            self._lost.setdefault(ino, set()).update(lease.kernel_names)
            self._forget(ino)
        else:
            self._bump(ino)

    def drop_all(self) -> None:
        """Every lease goes (a new leader; the session ended)."""
        if not self._held and not self.unannounced:
            return
        for ino, lease in self._held.items():
            self._lost.setdefault(ino, set()).update(lease.kernel_names)
        self._report.update(self.unannounced)
        self.unannounced.clear()
        self._held.clear()
        self._stamp += 1
        self._all_changed = self._stamp

    def news(self, news: LeaseNews, sent: float) -> None:
        """A poll sent at ``sent`` was answered: drop what is revoked (owing
        acks), then take the renewal."""
        if news.term < self.term:
            return  # from a deposed leader
        if news.term > self.term:
            self.drop_all()
            self.term = news.term
        self.length = news.ms / 1000
        for rev, ino in news.revoke:
            self._drop(ino)
            self._acks.add(rev)
            self.stats["revoked"] += 1
        self.renewed = max(self.renewed, sent)

    def outgoing(self) -> PollState:
        """What the next poll says, taken at once (acks go out only after the
        kernel's caches of ``lost`` are gone: the caller invalidates first)."""
        state = PollState(
            tuple(self._acks),
            tuple(self._drops),
            tuple(self._report),
            self.held_term(),
            tuple((ino, tuple(names)) for ino, names in self._lost.items()),
        )
        self._acks.clear()
        self._drops.clear()
        self._report.clear()
        self._lost.clear()
        return state

    def resend(self, state: PollState) -> None:
        """The poll carrying ``state`` failed: say it again next time."""
        self._acks.update(state.acks)
        self._drops.update(state.drops)
        self._report.update(state.opens)

    def lost(self) -> bool:
        """Whether the front end has kernel caches to invalidate (the poll
        loop wakes for it: a term change seen in a grant)."""
        return bool(self._lost)

    # -- own mutations ---------------------------------------------------------------

    def begin_mutation(self, inos: Iterable[int], report: bool = True) -> OwnChange:
        """Our own change of ``inos`` is about to be sent: answers about them
        in flight are refused from now on. Returns the inodes whose leases we
        keep (all of them: the leader keeps ours and revokes everyone
        else's) and which of them we have open unannounced (reported now:
        an unlink must know they are open, and a commit that trashes
        slices that a reader here may hold; ``report`` false: the change
        can do neither)."""
        kept = tuple(inos)
        for ino in kept:
            self._busy[ino] = self._busy.get(ino, 0) + 1
            self._own[ino] = self._own.get(ino, 0) + 1
            self._bump(ino)
        opens = tuple(i for i in kept if i in self.unannounced) if report else ()
        self.unannounced.difference_update(opens)
        return OwnChange(kept, opens, tuple(self._own[i] for i in kept))

    def end_mutation(
        self,
        change: OwnChange,
        names: Iterable[tuple[int, bytes]],
        attr: Attr | None = None,
        others: Iterable[Attr] = (),
        rejected: bool = False,
        outcome: tuple[int | None, ...] | None = None,
    ) -> None:
        """Our change was answered (or failed): the attributes of its inodes
        are stale, unless ``attr`` (its answer) is one's and no other own
        change of it overlapped (see the module docstring); and so are the
        ``(directory, name)`` entries it changed (the kernel may know them
        still, moved by its own rename: they are invalidated with the
        directory's lease), unless the answer is an inode's attributes (a
        create or link: the name is that inode's now) and no other own
        change of the directory overlapped. ``others``: attributes of more
        of its inodes that came with the answer (a create's directory),
        kept as ``attr`` is. What we knew of their extended attributes is
        dropped (our change may have set some). ``rejected``: the namespace
        refused the change (:data:`REJECTIONS`), which changed nothing, so
        everything we knew stays: forgetting a name here would leave the next
        change of it unable to name the inode it resolves to, and the leader
        would revoke our own lease on that inode while our kernel holds its
        lock for that change (the revocation then lapses: a lease term).
        ``outcome``: what each of ``names`` is after a change that
        succeeded and said so (None: no such name; an unlink's name, a
        rename's old one; else its inode: a rename's new name): kept where
        no other own change of the directory overlapped, and a directory
        known ``complete`` stays so."""
        alone: set[int] = set()
        for ino, began in zip(change.kept, change.began, strict=True):
            if self._busy[ino] == 1 and self._own[ino] == began:
                alone.add(ino)
            left = self._busy[ino] - 1
            if left:
                self._busy[ino] = left
                self._own[ino] += 1
            else:
                del self._busy[ino]
                del self._own[ino]
            self._bump(ino)
            lease = self._held.get(ino)
            if lease is not None and not rejected:
                lease.attr = attr if ino in alone and attr is not None and attr.ino == ino else None
                lease.xattrs.clear()
                lease.bare = False
        for other in others:
            lease = self._held.get(other.ino)
            if lease is not None and other.ino in alone:
                lease.attr = other
        for i, (parent, name) in enumerate(() if rejected else names):
            lease = self._held.get(parent)
            if lease is None:
                continue
            lease.kernel_names.add(name)
            if parent in alone and outcome is not None:
                now_ino = outcome[i]
                if now_ino is None:
                    lease.entries.pop(name, None)
                else:
                    lease.entries[name] = now_ino
            elif parent in alone and attr is not None:
                lease.entries[name] = attr.ino  # a create or link: the name is that inode now
            else:
                lease.entries.pop(name, None)
                lease.complete = False

    def closed(self, ino: int) -> bool:
        """The last open of ``ino`` here ended: whether the leader must hear
        it (it knows of the open). An unannounced open, or one lost with its
        lease and not reported yet, ends here."""
        if ino in self.unannounced:
            self.unannounced.discard(ino)
            return False
        if ino in self._report:
            self._report.discard(ino)
            return False
        return True

    def busy(self, ino: int) -> bool:
        """Our own change of ``ino`` is in flight (the kernel holds the
        directory's lock for it meanwhile)."""
        return ino in self._busy

    def held(self, ino: int) -> Lease | None:
        """The lease on ``ino`` whether or not it is still valid (for our own
        changes to update what it knows)."""
        return self._held.get(ino)

    def lose(self, ino: int) -> None:
        """Give the lease on ``ino`` up (an own change whose outcome is
        unknown); the leader hears it with the next poll."""
        if ino in self._held:
            self._drop(ino)
            self._drops.add(ino)
