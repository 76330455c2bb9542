"""Hedged requests: a second try of a slow call after a delay learnt from the recent ones.

Object stores have long tails: most ranged GETs answer in milliseconds, a
few take seconds (a slow disk or a busy front end behind the same name).
Waiting on those stalls a training step, so, as "The Tail at Scale" (Dean
and Barroso) does, a GET that has not answered by the 95th percentile of
recent GETs is sent once more; the first answer wins and the other is
cancelled. About 5% of calls cost a second request, and the tail becomes
roughly the time of two tries at the median instead of one at the tail.

:class:`Latencies` is the pure part (a sliding window and its percentile);
:func:`hedged` the trio driver.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

T = TypeVar("T")


class Latencies:
    """The last ``window`` latencies (seconds); :meth:`delay` is when to hedge."""

    def __init__(self, window: int = 256, *, quantile: float = 0.95, floor: float = 0.01,
                 first: float = 1.0, min_samples: int = 16) -> None:  # fmt: skip
        self._recent: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []
        self.quantile = quantile
        self.floor = floor  # never hedge sooner: a fast store's jitter is not a tail
        self.first = first  # the delay before enough samples are known
        self.min_samples = min_samples

    def add(self, seconds: float) -> None:
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(seconds)
        bisect.insort(self._sorted, seconds)

    def delay(self) -> float:
        if len(self._sorted) < self.min_samples:
            return self.first
        index = min(len(self._sorted) - 1, int(self.quantile * len(self._sorted)))
        return max(self.floor, self._sorted[index])


async def hedged(call: Callable[[], Awaitable[T]], latencies: Latencies,
                 on_hedge: Callable[[], None] | None = None) -> T:  # fmt: skip
    """``call()``, and once more if it has neither answered nor failed after
    ``latencies.delay()``; the first answer is the result and the other try is
    cancelled. A failure with no other try under way is raised at once (a
    failure is not a slow answer: boto3 has retried what can be retried), and
    only answers count as latencies."""
    results: list[T] = []
    errors: list[Exception] = []
    running = 0

    async def attempt(cancel: trio.CancelScope) -> None:
        nonlocal running
        running += 1
        started = trio.current_time()
        try:
            value = await call()
        except Exception as exc:
            errors.append(exc)
            running -= 1
            if not running:
                cancel.cancel()  # nothing else will answer
            return
        latencies.add(trio.current_time() - started)
        results.append(value)
        cancel.cancel()  # the first answer wins

    async with trio.open_nursery() as nursery:
        nursery.start_soon(attempt, nursery.cancel_scope)
        await trio.sleep(latencies.delay())
        if not results and not errors:
            if on_hedge is not None:
                on_hedge()
            nursery.start_soon(attempt, nursery.cancel_scope)
    if results:
        return results[0]
    raise errors[-1]
