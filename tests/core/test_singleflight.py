"""cachefs.singleflight: one run per key, its outcome shared, cancellation not shared."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

from cachefs.errors import NotFound, Unavailable
from cachefs.singleflight import SingleFlight


class Job:
    """A job that counts its runs and finishes when told to."""

    def __init__(self, result: object = b"block", error: Exception | None = None) -> None:
        self.result = result
        self.error = error
        self.runs = 0
        self.release = trio.Event()

    async def __call__(self) -> object:
        self.runs += 1
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return self.result


async def test_concurrent_callers_share_one_run() -> None:
    flights: SingleFlight[str, object] = SingleFlight()
    job = Job()
    got: list[object] = []

    async def ask() -> None:
        got.append(await flights.run("k", job))

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        assert "k" in flights and len(flights) == 1
        job.release.set()
    assert job.runs == 1 and got == [b"block"] * 10
    assert "k" not in flights
    await flights.run("k", job)  # not a cache: a later caller runs it again
    assert job.runs == 2


async def test_an_error_reaches_every_waiter_as_its_own_copy() -> None:
    flights: SingleFlight[str, object] = SingleFlight()
    job = Job(error=Unavailable("datanodes down", shards=3))
    errors: list[BaseException] = []

    async def ask() -> None:
        try:
            await flights.run("k", job)
        except Unavailable as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        job.release.set()
    assert job.runs == 1 and len(errors) == 3
    assert len({id(e) for e in errors}) == 3
    assert {(e.message, e.details["shards"]) for e in errors} == {("datanodes down", 3)}


async def test_a_cancelled_runner_does_not_fail_its_waiters() -> None:
    flights: SingleFlight[str, object] = SingleFlight()
    job = Job()
    got: list[object] = []
    runner = trio.CancelScope()

    async def first() -> None:
        with runner:
            await flights.run("k", job)

    async def second() -> None:
        got.append(await flights.run("k", job))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert job.runs == 1
        runner.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert job.runs == 2  # the waiter took the run over
        job.release.set()
    assert got == [b"block"]


async def test_a_detached_flight_outlives_its_caller_and_keeps_the_key_during_then() -> None:
    flights: SingleFlight[str, object] = SingleFlight()
    job = Job()
    stored = trio.Event()
    kept: list[object] = []

    async def then(value: object) -> None:
        kept.append(value)
        await stored.wait()

    async with trio.open_nursery() as nursery:
        with trio.move_on_after(0.01):  # the caller gives up
            await flights.start("k", job, nursery=nursery, then=then).wait()
        job.release.set()
        flight = flights.get("k")
        assert flight is not None
        assert await flight.wait() == b"block"
        await trio.testing.wait_all_tasks_blocked()
        # During ``then`` the key is still taken: a new caller joins, no new run.
        assert flights.start("k", job, nursery=nursery) is flight and flight.ready
        assert not flight.finished.is_set()
        stored.set()
        await flight.finished.wait()
    assert job.runs == 1 and kept == [b"block"] and "k" not in flights


async def test_a_detached_error_is_raised_to_waiters_and_frees_the_key(nursery) -> None:
    flights: SingleFlight[str, object] = SingleFlight()
    job = Job(error=NotFound("no such block"))
    flight = flights.start("k", job, nursery=nursery)
    job.release.set()
    with pytest.raises(NotFound, match="no such block"):
        await flight.wait()
    await flight.finished.wait()
    assert "k" not in flights and not flight.ready


async def test_run_many_settles_each_key_and_a_miss_is_run_alone_by_its_waiter() -> None:
    flights: SingleFlight[str, str] = SingleFlight()
    go = trio.Event()
    asked: list[list[str]] = []
    singles: list[str] = []

    async def batch(keys: list[str]) -> dict[str, str]:
        asked.append(keys)
        await go.wait()
        return {k: k.upper() for k in keys if k != "miss"}

    async def single(key: str) -> str:
        singles.append(key)
        return key + "!"

    got: dict[str, str] = {}

    async def read(key: str) -> None:
        got[key] = await flights.run(key, functools.partial(single, key))

    async with trio.open_nursery() as n:
        async def many() -> None:
            got.update(await flights.run_many(["a", "miss", "b", "a"], batch))

        n.start_soon(many)
        await trio.testing.wait_all_tasks_blocked()
        assert "a" in flights and "miss" in flights
        n.start_soon(read, "a")  # joins the batch
        n.start_soon(read, "miss")  # joins it, then runs its own job
        await trio.testing.wait_all_tasks_blocked()
        second: dict[str, str] = {}

        async def again() -> None:
            second.update(await flights.run_many(["a", "c"], batch))  # "a" is under way: not asked again

        n.start_soon(again)
        await trio.testing.wait_all_tasks_blocked()
        go.set()
    assert asked[0] == ["a", "miss", "b"] and asked[1] == ["c"]
    assert second == {"c": "C"}
    assert got == {"a": "A", "b": "B", "miss": "miss!"} and singles == ["miss"]
    assert len(flights) == 0
