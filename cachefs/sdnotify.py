"""systemd's readiness and watchdog notifications (the sd_notify protocol), for every daemon.

Under a ``Type=notify`` unit systemd puts the path of a datagram socket in
``NOTIFY_SOCKET`` and counts the service as started only when it reads
``READY=1`` there: each daemon calls :func:`serving` once it accepts
connections, so units ordered after it start against a daemon that answers.
With ``WatchdogSec=`` systemd also sets ``WATCHDOG_USEC`` and restarts the
service when no ``WATCHDOG=1`` arrives for that long. The pings come from a
task in the daemon's own trio loop, every half of that interval: a loop that
hangs (a blocking call, a handler that never yields) stops them, which is the
point; a thread would keep pinging for a dead daemon.

The protocol is one ``KEY=VALUE`` text per datagram on an ``AF_UNIX`` socket
(a leading ``@`` names the abstract namespace), small enough to speak
directly. Outside systemd (no ``NOTIFY_SOCKET``) every call does nothing. A
notification that cannot be sent is logged once and never stops the daemon.
"""

from __future__ import annotations

import logging
import os
import socket

import trio

log = logging.getLogger(__name__)

_warned = False


def notify(message: str) -> bool:
    """Send one notification (e.g. ``"READY=1"``); True if systemd got it."""
    global _warned
    path = os.environ.get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path[0] == "@":
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)  # a full queue drops this ping rather than stalling the loop
            sock.sendto(message.encode(), path)
    except OSError as exc:
        if not _warned:
            _warned = True
            log.warning("cannot notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between pings (half of ``WatchdogSec=``), or None when systemd wants none."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None  # no watchdog, or it watches another process (our parent, say)
    return int(usec) / 2e6


def serving(nursery: trio.Nursery, status: str) -> None:
    """Tell systemd the daemon serves (``status`` shows in ``systemctl status``); start the pings."""
    notify(f"READY=1\nSTATUS={status}")
    interval = watchdog_interval()
    if interval is not None:
        nursery.start_soon(_ping, interval)


async def _ping(interval: float) -> None:
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval)
