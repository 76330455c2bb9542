"""Single flight: one run of a job per key, however many tasks want its result.

Theory of operation
-------------------
A :class:`SingleFlight` maps a key to the :class:`Flight` under way for it.
The first task to ask runs the job; tasks that ask while it runs join the
flight and get its outcome when it settles. A key leaves the table when its
job ends, so a task asking after that runs the job again: this removes
duplicate concurrent work (a hundred readers of one cold block cost one
fetch), it is not a cache.

A job runs one of two ways:

- :meth:`SingleFlight.run` runs it in the asking task (the client's Reader:
  a read waits for its block anyway). If that task is cancelled, the flight
  settles with no outcome and each waiter tries again, one of them becoming
  the runner, instead of failing with someone else's cancellation.
- :meth:`SingleFlight.run_many` runs one job for many keys in the asking
  task (the client's batched prefetch: one ``get_many`` for a directory's
  next files): a flight per key not under way already, settled with the
  value the job returned for it. A key the job returned nothing for (a
  miss) settles with no outcome, like a cancelled runner: each waiter
  tries again, one of them running its own single job.
- :meth:`SingleFlight.start` runs it in a nursery, detached from every
  caller (the cache node: a reader that gives up must not cancel the fetch
  the others wait for). An optional ``then`` step runs after the result is
  known while the flight stays in the table, so a task asking meanwhile joins
  the settled flight instead of starting the job again (the cache node writes
  the block to flash there).

Only a ``CacheFSError`` is shared with the waiters, each raising its own copy
(one exception object raised in many tasks would collect all their
tracebacks). Any other exception is a bug: it propagates in the runner's task
(or its nursery); the waiters of a :meth:`~SingleFlight.run` try again, those
of a :meth:`~SingleFlight.start` get an ``IOFailure``.

No ``await`` happens between looking a key up and registering a flight for
it: that is what makes the flight single.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import trio

from cachefs.errors import CacheFSError, IOFailure

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Flight(Generic[V]):
    """One run of a job, shared by every task that asked while it ran."""

    __slots__ = ("_error", "_has_value", "_settled", "_value", "finished")

    def __init__(self) -> None:
        self._settled = trio.Event()
        self._value: V | None = None
        self._has_value = False
        self._error: CacheFSError | None = None
        self.finished = trio.Event()  # the key left the table (after ``then``)

    @property
    def ready(self) -> bool:
        """The job returned: :attr:`value` is its result."""
        return self._has_value

    @property
    def value(self) -> V:
        assert self._has_value, "the flight has no result yet"
        return self._value  # type: ignore[return-value]

    def _outcome(self) -> V:
        if self._error is not None:
            err = self._error
            raise type(err)(err.message, remote=err.remote, **err.details)
        if not self._has_value:  # a detached job that hit a bug (it went to its nursery)
            raise IOFailure("the shared job ended without a result")
        return self._value  # type: ignore[return-value]

    async def wait(self) -> V:
        """The job's result, once it is known.

        Raises:
            CacheFSError: a copy of the job's error.
        """
        await self._settled.wait()
        return self._outcome()


class SingleFlight(Generic[K, V]):
    """The flights under way, by key (see module docstring)."""

    def __init__(self) -> None:
        self._flights: dict[K, Flight[V]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def __contains__(self, key: K) -> bool:
        return key in self._flights

    def get(self, key: K) -> Flight[V] | None:
        return self._flights.get(key)

    async def run(self, key: K, job: Callable[[], Awaitable[V]]) -> V:
        """``await job()`` in this task, or the result of the run under way for ``key``.

        Raises:
            CacheFSError: the job's error (a copy, in the tasks that joined).
        """
        while True:
            flight = self._flights.get(key)
            if flight is None:
                break
            await flight._settled.wait()
            if flight._has_value or flight._error is not None:
                return flight._outcome()
            # Its runner was cancelled (or hit a bug): run it ourselves.
        flight = self._flights[key] = Flight()
        try:
            value = await job()
        except CacheFSError as exc:
            flight._error = exc
            raise
        else:
            flight._value, flight._has_value = value, True
            return value
        finally:
            del self._flights[key]
            flight._settled.set()
            flight.finished.set()

    async def run_many(self, keys: list[K], job: Callable[[list[K]], Awaitable[dict[K, V]]]) -> dict[K, V]:
        """``await job(mine)`` in this task for the keys of ``keys`` no flight
        is under way for (``mine``, in order); each of those keys' flights
        settles with ``job``'s value for it, or with no outcome (its waiters
        run their own jobs) if the job returned none for it or failed.
        Returns what the job returned (keys under way already are not waited for).

        Raises:
            CacheFSError: the job's error (its keys' waiters try again themselves).
        """
        flights: dict[K, Flight[V]] = {}
        for key in keys:  # no await between the lookups and the registrations
            if key not in self._flights and key not in flights:
                flights[key] = self._flights[key] = Flight()
        got: dict[K, V] = {}
        try:
            if flights:
                got = await job(list(flights))
            return got
        finally:
            for key, flight in flights.items():
                del self._flights[key]
                if key in got:
                    flight._value, flight._has_value = got[key], True
                flight._settled.set()
                flight.finished.set()

    def start(
        self,
        key: K,
        job: Callable[[], Awaitable[V]],
        *,
        nursery: trio.Nursery,
        then: Callable[[V], Awaitable[object]] | None = None,
    ) -> Flight[V]:
        """The flight for ``key``: the one under way, else ``job`` started in ``nursery``.

        ``then(result)`` runs after a successful job, before the key leaves
        the table; it must handle its own ``CacheFSError``.
        """
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = Flight()
            nursery.start_soon(self._detached, key, flight, job, then)
        return flight

    async def _detached(
        self,
        key: K,
        flight: Flight[V],
        job: Callable[[], Awaitable[V]],
        then: Callable[[V], Awaitable[object]] | None,
    ) -> None:
        try:
            try:
                value = await job()
            except CacheFSError as exc:
                flight._error = exc
                return
            flight._value, flight._has_value = value, True
            flight._settled.set()  # waiters are served while ``then`` runs
            if then is not None:
                await then(value)
        finally:
            flight._settled.set()
            del self._flights[key]
            flight.finished.set()
