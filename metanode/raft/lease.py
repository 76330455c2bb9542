"""The leader's read lease: serve a read without a round to the followers.

Theory of operation
-------------------
A read-index round proves that a quorum still followed us when it began:
each of them answered a heartbeat sent after the round started. A follower
that hears from its leader ignores votes for a newer term for the next
``election_tick`` ticks of its own clock (check-quorum's follower lease in
``core.py``; a replica that restarts with a term on disk does the same for
its first ``election_tick`` ticks, since it may have promised it before the
crash). So until the earliest of those promises runs out, no other leader can
be elected, and this leader's applied state answers reads linearizably.

The leader takes a lease of ``LEASE_FRACTION`` of an election timeout from
the *start* of the round that confirmed it (``confirmed(epoch, started)``),
by its own clock, and serves reads while ``valid(epoch, now)``. The follower's
promise lasts at least ``election_tick - 1`` of its ticks after it received
the heartbeat (the first tick may come at once). So this is safe while
clocks run at rates within a factor of ``(election_tick - 1) /
(LEASE_FRACTION * election_tick)`` of each other (1.8 for the default 10
ticks), the assumption etcd's lease reads make too. The epoch is the leader's term
and the index of its configuration (``RaftCore.conf_index``): a new term
ends the lease, and so does a membership change, since the quorum that
promised may not overlap every quorum two changes later. Pure: the caller
passes the clock.
"""

from __future__ import annotations

LEASE_FRACTION = 0.5  # of the shortest election timeout


def lease_duration(election_tick: int, tick_interval: float) -> float:
    """How long a confirmation lasts, in the units of ``tick_interval``."""
    return LEASE_FRACTION * election_tick * tick_interval


class ReadLease:
    __slots__ = ("duration", "_epoch", "_until")

    def __init__(self, duration: float) -> None:
        self.duration = duration
        self._epoch = (-1, -1)
        self._until = 0.0

    def valid(self, epoch: tuple[int, int], now: float) -> bool:
        """May a leader in ``epoch`` (term, conf_index) answer a read at
        ``now`` by itself?"""
        return epoch == self._epoch and now < self._until

    def confirmed(self, epoch: tuple[int, int], started: float) -> None:
        """A read-index round that began at ``started`` (before its
        heartbeats left) in ``epoch`` confirmed our leadership; the caller
        checks that the epoch did not change during the round."""
        until = started + self.duration
        if epoch != self._epoch or until > self._until:
            self._epoch = epoch
            self._until = until
