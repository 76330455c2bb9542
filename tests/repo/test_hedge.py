"""The hedging core: the latency window, and hedged() under trio's virtual clock."""

from __future__ import annotations

import pytest
import trio

from cachefs.errors import NotFound
from cachefs.repo.hedge import Latencies, hedged


def test_the_delay_is_the_recent_95th_percentile_with_a_floor() -> None:
    lat = Latencies(window=100, first=2.0, min_samples=10, floor=0.01)
    for _ in range(9):
        lat.add(0.05)
    assert lat.delay() == 2.0  # too few samples yet
    lat.add(0.05)
    assert lat.delay() == 0.05
    for i in range(100):
        lat.add(0.001 * (i + 1))  # the old samples slide out
    assert lat.delay() == pytest.approx(0.096)
    for _ in range(100):
        lat.add(0.0001)
    assert lat.delay() == 0.01


async def test_a_slow_call_is_tried_again_and_the_first_answer_wins(autojump_clock: trio.abc.Clock) -> None:
    lat = Latencies(first=1.0)
    calls: list[float] = []
    cancelled: list[int] = []

    async def call() -> str:
        n = len(calls)
        calls.append(trio.current_time())
        try:
            await trio.sleep(30.0 if n == 0 else 0.2)
        except trio.Cancelled:
            cancelled.append(n)
            raise
        return f"try {n}"

    hedges = []
    start = trio.current_time()
    assert await hedged(call, lat, lambda: hedges.append(1)) == "try 1"
    assert trio.current_time() - start == pytest.approx(1.2)
    assert calls == [pytest.approx(start), pytest.approx(start + 1.0)] and cancelled == [0] and hedges == [1]
    assert lat.delay() == 1.0 and len(lat._sorted) == 1  # the answer's 0.2 s, not the cancelled try


async def test_a_fast_answer_or_failure_is_not_hedged(autojump_clock: trio.abc.Clock) -> None:
    lat = Latencies(first=1.0)
    calls = []

    async def ok() -> int:
        calls.append(1)
        await trio.sleep(0.1)
        return 7

    assert await hedged(ok, lat) == 7 and calls == [1]

    async def fails() -> int:
        calls.append(2)
        await trio.sleep(0.1)
        raise NotFound("gone")

    start = trio.current_time()
    with pytest.raises(NotFound, match="gone"):
        await hedged(fails, lat)
    assert trio.current_time() - start == pytest.approx(0.1) and calls == [1, 2]


async def test_when_both_tries_fail_the_last_error_is_raised(autojump_clock: trio.abc.Clock) -> None:
    lat = Latencies(first=1.0)
    n = 0

    async def slow_then_fail() -> int:
        nonlocal n
        n += 1
        mine = n
        await trio.sleep(5.0 if mine == 1 else 0.5)
        raise NotFound(f"try {mine}")

    with pytest.raises(NotFound, match="try 1"):
        await hedged(slow_then_fail, lat)  # the hedge fails at 1.5 s, the first at 5 s: last
