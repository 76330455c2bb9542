"""Real metanode processes on 127.0.0.1 (insecure, on free ports) for tests and the
metadata benchmarks: each ``cachefs metanode`` with its own data directory and log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio

from cachefs.errors import CacheFSError
from cachefs.rpc import RpcPool
from cachefs.testing.ports import free_ports

START_GUARD = 120.0  # seconds the replicas may take to answer at all (process start under load)


class MetaCluster:
    """``n`` ``cachefs metanode`` processes with data dirs under ``root``."""

    def __init__(self, root: Path, n: int = 3, *, extra: list[str] | None = None,
                 log_level: str = "info", peer_addrs: list[str] | None = None,
                 node_extra: dict[int, list[str]] | None = None) -> None:
        """``peer_addrs``: where the replicas reach each other, when that is
        not where they listen (``addrs``), e.g. a relay in between;
        ``node_extra``: more arguments for replica ``i`` alone."""
        self.root = root
        self.ports = free_ports(n)
        self.addrs = [f"127.0.0.1:{p}" for p in self.ports]
        self.peers = ",".join(f"{i + 1}={a}" for i, a in enumerate(peer_addrs or self.addrs))
        self.extra = extra or []
        if peer_addrs:
            self.extra_for = {i: ["--listen", a] for i, a in enumerate(self.addrs)}
        else:
            self.extra_for = {}
        for i, more in (node_extra or {}).items():
            self.extra_for[i] = [*self.extra_for.get(i, []), *more]
        self.log_level = log_level
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, i: int) -> None:
        log = open(self.root / f"meta{i}.log", "ab")  # noqa: SIM115 - the child owns it
        self.procs[i] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cachefs.cli",
                "metanode",
                "--id",
                str(i + 1),
                "--peers",
                self.peers,
                "--data-dir",
                str(self.root / f"meta{i}"),
                "--insecure",
                "--log-level",
                self.log_level,
                *self.extra,
                *self.extra_for.get(i, []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()

    def start_all(self) -> None:
        for i in range(len(self.addrs)):
            self.start(i)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(i)
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop_all(self) -> None:
        for i in list(self.procs):
            self.kill(i, signal.SIGTERM)

    async def status(self, pool: RpcPool, i: int) -> dict | None:
        try:
            return (await pool.call(self.addrs[i], "meta_status", {}, timeout=1.0)).result
        except CacheFSError:
            return None

    async def wait_leader(self, pool: RpcPool, timeout: float = 20.0) -> int:
        """Index of the replica that leads, once one does and every running replica answers.

        Two replicas elect a leader while a slow third may still be starting:
        tests that talk to a follower need it listening. ``timeout`` is the
        election's and counts from when every running replica answers: on a
        loaded machine starting the processes alone can take longer than that
        (``START_GUARD`` is the hang guard while some do not answer yet).
        """
        started = time.monotonic()
        deadline: float | None = None
        while True:
            statuses = {i: await self.status(pool, i) for i in self.procs}
            leaders = [i for i, st in statuses.items() if st and st["is_leader"]]
            if leaders and all(statuses.values()):
                return leaders[0]
            now = time.monotonic()
            if deadline is None and all(statuses.values()):
                deadline = now + timeout
            if deadline is not None and now > deadline:
                raise TimeoutError(f"no metanode leader within {timeout:.0f} s of every replica answering")
            if now - started > START_GUARD:
                silent = sorted(i for i, st in statuses.items() if not st)
                raise TimeoutError(f"metanodes {silent} still not answering after {START_GUARD:.0f} s")
            for i, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"metanode {i} exited: see {self.root / f'meta{i}.log'}")
            await trio.sleep(0.1)
