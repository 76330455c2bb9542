"""A readable dump of every trio task of this process and where it waits.

py-spy and faulthandler see only the thread's stack, which in an idle trio
program is the scheduler's ``epoll_wait``; what a hung request waits on is in
the suspended coroutines. :func:`task_tree` walks the task tree from the root
and, for each task, the chain of awaits (``cr_await``) down to the innermost
frame. The mount logs it on SIGUSR1 (``kill -USR1 PID``).
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import trio


def _frames(coro: object) -> Iterator[str]:
    """``file:line function`` of each suspended frame, outermost first."""
    seen = 0
    while coro is not None and seen < 64:
        seen += 1
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:  # e.g. a Cython coroutine (pyfuse3's handlers)
            yield f"<{getattr(coro, '__qualname__', type(coro).__qualname__)}>"
        else:
            yield f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
        nxt = getattr(coro, "cr_await", None)
        if nxt is None:
            nxt = getattr(coro, "gi_yieldfrom", None)
        if nxt is None or isinstance(nxt, types.FrameType):
            return
        coro = nxt


def task_tree(root: trio.lowlevel.Task | None = None) -> str:
    """Every task under ``root`` (default: the run's root task) with its awaits."""
    root = root or trio.lowlevel.current_root_task()
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        pad = "  " * depth
        lines.append(f"{pad}task {task.name}")
        for frame in _frames(task.coro):
            lines.append(f"{pad}  | {frame}")
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    if root is not None:
        walk(root, 0)
    return "\n".join(lines)
