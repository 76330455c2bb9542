"""Task helpers: parallel batches, and background tasks that cannot take a service down.

:func:`run_all`: trio wraps errors from a nursery in an ExceptionGroup;
callers of the read and write paths want the ``CacheFSError`` (it carries
the errno the FUSE layer answers with), so the first one cancels the rest and
is raised unwrapped.

:class:`TaskGuard`: the boundary of a long-lived service's background tasks
(see its docstring).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import trio

from cachefs.errors import CacheFSError

log = logging.getLogger(__name__)


async def run_all(jobs: Iterable[Callable[[], Awaitable[object]]]) -> None:
    """Await every job concurrently.

    Raises:
        CacheFSError: the first one a job raised (the others are cancelled).
    """
    errors: list[CacheFSError] = []

    async with trio.open_nursery() as nursery:

        async def one(job: Callable[[], Awaitable[object]]) -> None:
            try:
                await job()
            except CacheFSError as exc:
                errors.append(exc)
                nursery.cancel_scope.cancel()

        for job in jobs:
            nursery.start_soon(one, job)
    if errors:
        raise errors[0]


class Spawner(Protocol):
    """What starts a background task: a trio nursery, or a :class:`TaskGuard` over one."""

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object, name: object = None) -> None: ...


class TaskGuard:
    """Starts the background tasks of a long-lived service (a mount) in one nursery
    so that an unexpected exception ends only the task that raised it.

    A trio nursery cancels everything in it when one child raises; in a mount
    that nursery also runs the FUSE loop, so a bug in an upload, a compaction
    or the session's upkeep would unmount the filesystem under every process
    using it. Here the task boundary catches any ``Exception``, logs it with
    its traceback and counts it in :attr:`failures` (by task name; the mount
    exports it as ``cachefs_mount_task_failures_total``). A task started with
    ``restart=True`` (a loop the service needs, e.g. session upkeep) runs
    again after ``restart_delay`` seconds. Cancellation and other
    ``BaseException`` still propagate: they are how the service stops.

    The task itself stays responsible for what its failure means to others:
    an upload that dies marks its file failed first, so a later ``fsync``
    reports the loss instead of succeeding.
    """

    def __init__(self, nursery: trio.Nursery, *, restart_delay: float = 1.0) -> None:
        self.nursery = nursery
        self.restart_delay = restart_delay
        self.failures: Counter[str] = Counter()

    def start_soon(
        self,
        fn: Callable[..., Awaitable[object]],
        *args: object,
        name: object = None,
        restart: bool = False,
    ) -> None:
        what = str(name) if name is not None else _task_name(fn)
        self.nursery.start_soon(self._guarded, what, fn, args, restart, name=what)

    async def _guarded(
        self, what: str, fn: Callable[..., Awaitable[object]], args: tuple[object, ...], restart: bool
    ) -> None:
        while True:
            failed = False
            try:
                await fn(*args)
            except* Exception as group:
                failed = True
                self.failures[what] += 1
                again = "; restarting it" if restart else ""
                log.error(
                    "background task %s failed unexpectedly%s; everything else keeps running",
                    what, again, exc_info=group.exceptions[0] if len(group.exceptions) == 1 else group,
                )  # fmt: skip
            if not (failed and restart):
                return
            await trio.sleep(self.restart_delay)


def _task_name(fn: Callable[..., object]) -> str:
    """``Class.method`` or ``function``: the label a failure is counted under."""
    target = getattr(fn, "func", fn)  # functools.partial
    return str(getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target)))
