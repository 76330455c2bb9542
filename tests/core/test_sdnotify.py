"""sd_notify for real: each daemon, started the way a ``Type=notify`` unit starts it,
says READY=1 only once it answers RPCs, then pings the watchdog from its trio loop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from cachefs import sdnotify
from cachefs.rpc import RpcPool
from cachefs.testing.notify import NotifySocket
from cachefs.testing.ports import free_port

WATCHDOG_USEC = 400_000  # WatchdogSec=0.4: a ping every 0.2 s


@pytest.fixture
def notify_socket() -> Iterator[NotifySocket]:
    sock = NotifySocket()
    try:
        yield sock
    finally:
        sock.close()


# ---------------------------------------------------------------- the protocol


def test_notify_speaks_to_path_and_abstract_sockets(tmp_path: Path, monkeypatch, notify_socket) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False  # not under systemd: nothing to do
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.name)
    assert sdnotify.notify("READY=1\nSTATUS=x")
    assert notify_socket.wait_for("READY=1", 5) == "READY=1\nSTATUS=x"
    path = tmp_path / "n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sdnotify.notify("WATCHDOG=1")
        assert sock.recv(100) == b"WATCHDOG=1"


@pytest.mark.allow_log("cachefs.sdnotify", "cannot notify systemd")
def test_a_missing_socket_is_logged_once_and_never_raises(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    monkeypatch.setattr(sdnotify, "_warned", False)
    assert sdnotify.notify("WATCHDOG=1") is False
    assert sdnotify.notify("WATCHDOG=1") is False
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "cannot notify systemd" in caplog.text


def test_watchdog_interval(monkeypatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert sdnotify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert sdnotify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getppid()))  # meant for another process
    assert sdnotify.watchdog_interval() is None


def test_pings_come_from_the_loop_so_a_hung_loop_stops_them(monkeypatch, notify_socket) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.name)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    pings: list[float] = []
    reader = threading.Thread(target=lambda: pings.extend(notify_socket.pings(3.0)))
    reader.start()
    hung: list[float] = []

    async def daemon() -> None:
        async with trio.open_nursery() as nursery:
            sdnotify.serving(nursery, "test")
            await trio.sleep(0.6)
            hung.append(time.monotonic())
            time.sleep(1.2)  # a handler that blocks the loop: systemd must see the pings stop
            hung.append(time.monotonic())
            await trio.sleep(0.6)
            nursery.cancel_scope.cancel()

    trio.run(daemon)
    reader.join()
    start, end = hung
    assert notify_socket.received[0][1] == "READY=1\nSTATUS=test"
    assert sum(t < start for t in pings) >= 2 and sum(t > end for t in pings) >= 2, (hung, pings)
    during = [t for t in pings if start + 0.1 < t < end]
    assert not during, f"pinged while the loop was blocked ({start:.2f}..{end:.2f}): {during}"


# ---------------------------------------------------------------- the daemons


def daemon_argv(kind: str, root: Path) -> list[str]:
    if kind == "metanode":
        return ["metanode", "--id", "1", "--peers", f"1=127.0.0.1:{free_port()}", "--data-dir", str(root)]
    if kind == "datanode":
        return ["datanode", "--zone", "z1", "--data-dir", str(root), "--capacity", "1G", "--listen", f"127.0.0.1:{free_port()}"]
    return ["cachenode", "--zone", "z1", "--cache-dir", str(root), "--capacity", "64M", "--listen", f"127.0.0.1:{free_port()}",
            "--no-rdma"]  # fmt: skip


async def _health(addr: str) -> dict:
    async with RpcPool(secret=None) as pool:
        return (await pool.call(addr, "health", timeout=5)).result


@pytest.mark.parametrize("kind", ["metanode", "datanode", "cachenode"])
def test_daemon_is_ready_only_when_it_serves_and_pings_the_watchdog(kind, tmp_path: Path, notify_socket) -> None:
    log = (tmp_path / "log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", *daemon_argv(kind, tmp_path / "d"), "--insecure"],
                            env=notify_socket.env(WATCHDOG_USEC), stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        ready = notify_socket.wait_for("READY=1", 60, alive=lambda: proc.poll() is None)
        # The first attempt, right after READY: a daemon that said READY before listening fails it.
        addr = ready.rsplit(" ", 1)[1]
        assert trio.run(_health, addr)["service"] == kind
        assert notify_socket.received[0][1] == ready, "something came before READY=1"
        assert ready.startswith(f"READY=1\nSTATUS={kind} ")
        pings = notify_socket.pings(1.5)
        assert len(pings) >= 4, notify_socket.received
        assert max(b - a for a, b in zip(pings, pings[1:], strict=False)) < WATCHDOG_USEC / 1e6, pings
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=30)
        log.close()
    assert status == 0, (tmp_path / "log").read_text()
