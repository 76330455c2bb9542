"""The task dump names every task and the line each one waits at."""

from __future__ import annotations

import trio
import trio.testing

from cachefs.taskdump import task_tree


async def waits_on_an_event(event: trio.Event) -> None:
    await event.wait()


async def test_task_tree_shows_where_each_task_waits() -> None:
    event = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits_on_an_event, event, name="the-waiter")
        await trio.testing.wait_all_tasks_blocked()
        dump = task_tree()
        event.set()
    lines = dump.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == "task the-waiter")
    assert "test_taskdump.py" in lines[at + 1] and lines[at + 1].endswith("waits_on_an_event")
    assert "test_task_tree_shows_where_each_task_waits" in dump  # the parent, with its nursery
