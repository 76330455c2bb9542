"""Run a batch of jobs in parallel and surface the first cachefs error as itself.

trio wraps errors from a nursery in an ExceptionGroup; callers of the read and
write paths want the ``CacheFSError`` (it carries the errno the FUSE layer
answers with), so the first one cancels the rest and is raised unwrapped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import trio

from cachefs.errors import CacheFSError


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
