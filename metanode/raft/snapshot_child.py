"""Serialize a state machine snapshot in a forked child process.

At a Ready boundary the driver forks: the child holds a copy-on-write view
of the state machine exactly as it was at the applied index, serializes it
into a pipe and exits, while the parent goes on stepping, persisting and
applying. The parent reads the pipe in a worker thread and reaps the child.

The child runs no trio code and touches no shared resource: it closes every
inherited descriptor but the pipe (a listener kept open there would hold the
port after the parent died), resets the signal wakeup fd and handlers, and
leaves with ``os._exit``. If the parent stops (is cancelled) while the child
runs, the child is killed and reaped: no stray process, no zombie.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import warnings
from collections.abc import Callable

import trio


class SnapshotChildFailed(Exception):
    """The child exited with a non-zero code (its serializer raised)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"snapshot child exited with {code}")
        self.code = code


class SnapshotChild:
    """One forked serialization: ``SnapshotChild.fork(fn)``, then
    ``await child.result()`` once."""

    def __init__(self, pid: int, read_fd: int) -> None:
        self.pid = pid
        self._read_fd = read_fd

    @classmethod
    def fork(cls, serialize: Callable[[], bytes]) -> SnapshotChild:
        """Fork a child that writes ``serialize()`` into a pipe and exits.
        The caller must not await between reading the state it wants and
        this call: the child sees memory as it is at the fork."""
        read_fd, write_fd = os.pipe()
        with warnings.catch_warnings():
            # 3.12+ warns about forking a process with threads (ours: WAL
            # workers); the child below uses none of their locks.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                # Drop our copies of the sockets and of trio's wakeup fds;
                # the parent's stay as they are.
                os.closerange(3, write_fd)
                os.closerange(write_fd + 1, os.sysconf("SC_OPEN_MAX"))
                gc.disable()
                if threading.current_thread() is threading.main_thread():
                    signal.set_wakeup_fd(-1)
                    for sig in (signal.SIGINT, signal.SIGTERM):
                        signal.signal(sig, signal.SIG_DFL)
                view = memoryview(serialize())
                while view:
                    view = view[os.write(write_fd, view):]
                code = 0
            finally:
                os._exit(code)
        os.close(write_fd)
        return cls(pid, read_fd)

    async def result(self) -> bytes:
        """The child's bytes, once it has exited and been reaped.

        Raises:
            SnapshotChildFailed: the child exited with a non-zero code.
        """
        read_fd, pid = self._read_fd, self.pid
        owner = threading.Lock()  # whoever takes it closes the pipe and reaps the child

        def collect() -> tuple[bytes, int]:
            if not owner.acquire(blocking=False):
                return b"", -1  # cancelled before this thread ran: cleaned up below
            try:
                with os.fdopen(read_fd, "rb") as pipe:
                    data = pipe.read()
            finally:
                _, status = os.waitpid(pid, 0)
            return data, os.waitstatus_to_exitcode(status)

        try:
            data, code = await trio.to_thread.run_sync(collect, abandon_on_cancel=True)
        except BaseException:
            # Stopped (or failed) while the child runs: end it. A thread that
            # already runs ``collect`` then reads EOF and reaps it.
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if owner.acquire(blocking=False):
                os.close(read_fd)
                threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True).start()
            raise
        if code != 0:
            raise SnapshotChildFailed(code)
        return data
