"""A stand-in for systemd's notification socket: what a ``Type=notify`` daemon tells it, and when."""

from __future__ import annotations

import os
import socket
import time


class NotifySocket:
    """An abstract ``AF_UNIX`` datagram socket, as systemd makes one for each service."""

    def __init__(self) -> None:
        self.name = f"@cachefs-test-notify-{os.getpid()}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name[1:])
        self.received: list[tuple[float, str]] = []  # (monotonic time, message)

    def env(self, watchdog_usec: int = 0) -> dict[str, str]:
        env = {**os.environ, "NOTIFY_SOCKET": self.name}
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        return env

    def wait_for(self, prefix: str, timeout: float, alive=lambda: True) -> str:
        """The next message that starts with ``prefix`` (earlier ones are kept in ``received``)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and alive(), f"no {prefix!r} within {timeout}s; got {self.received}"
            self.sock.settimeout(min(left, 0.2))
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            self.received.append((time.monotonic(), data))
            if data.startswith(prefix):
                return data

    def pings(self, seconds: float) -> list[float]:
        """Times of the WATCHDOG=1 pings that arrive within ``seconds``."""
        start = time.monotonic()
        times = []
        while (left := start + seconds - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                break
            self.received.append((time.monotonic(), data))
            if data == "WATCHDOG=1":
                times.append(time.monotonic())
        return times

    def close(self) -> None:
        self.sock.close()
