"""Real datanode processes on 127.0.0.1 (on free ports) for the backing-storage tests
and the cache tier's read-through tests: each ``cachefs datanode`` with its own data
directory and log, to be killed, paused, wiped and restarted like a real one."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cachefs.backing.cluster import ClusterView, DatanodeInfo
from cachefs.backing.policy import VolumePolicy
from cachefs.testing.ports import free_ports

SECRET = b"backing-test-secret"


class Datanodes:
    """A set of `cachefs datanode` processes, each with its own data dir and port."""

    def __init__(self, root: Path, zones: list[str], capacity: str = "4G", *,
                 insecure: bool = False, extra: list[str] | None = None) -> None:
        self.root = root
        self.zones = zones
        self.capacity = capacity
        self.insecure = insecure
        self.extra = extra or []
        self.secret_file = root / "secret"
        self.secret_file.write_bytes(SECRET)
        self.ports = free_ports(len(zones))
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(zones)

    def data_dir(self, i: int) -> Path:
        return self.root / f"dn{i}"

    def addr(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    @property
    def infos(self) -> list[DatanodeInfo]:
        return [DatanodeInfo(f"dn{i}", self.addr(i), z) for i, z in enumerate(self.zones)]

    def view(self, volumes: dict[str, VolumePolicy], pg_count: int = 16) -> ClusterView:
        return ClusterView.build(self.infos, {name: (p, pg_count) for name, p in volumes.items()})

    def start(self, *which: int) -> None:
        for i in which or range(len(self.zones)):
            log = open(self.root / f"dn{i}.log", "ab")  # noqa: SIM115 - the process owns it
            self.procs[i] = subprocess.Popen(
                [sys.executable, "-m", "cachefs.cli", "datanode", "--zone", self.zones[i],
                 "--data-dir", str(self.data_dir(i)), "--capacity", self.capacity,
                 "--listen", self.addr(i), "--node-id", f"dn{i}",
                 *(["--insecure"] if self.insecure else ["--secret-file", str(self.secret_file)]),
                 *self.extra],
                stdout=log, stderr=log)
            log.close()
        for i in which or range(len(self.zones)):
            self._wait_ready(i)

    def _wait_ready(self, i: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            proc = self.procs[i]
            assert proc is not None
            if proc.poll() is not None:
                raise RuntimeError(f"datanode {i} exited: {(self.root / f'dn{i}.log').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.ports[i]), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"datanode {i} did not start")

    def kill(self, i: int) -> None:
        """kill -9: no clean shutdown."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        self.procs[i] = None

    def pause(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)

    def resume(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.send_signal(signal.SIGCONT)

    def wipe(self, i: int) -> None:
        """Lose a datanode's disk (keeping its identity, as a replaced disk would)."""
        shutil.rmtree(self.data_dir(i) / "shards", ignore_errors=True)

    def ensure_running(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is not None:
                self.start(i)
            else:
                self.resume(i)

    def shard_files(self, i: int, volume: str) -> list[Path]:
        return sorted((self.data_dir(i) / "shards" / volume).rglob("*.*"))

    def shard_path(self, i: int, volume: str, key_hex: str, index: int) -> Path | None:
        found = list((self.data_dir(i) / "shards" / volume).glob(f"*/{key_hex}.{index}"))
        return found[0] if found else None

    def stop_all(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.procs[i] = None
