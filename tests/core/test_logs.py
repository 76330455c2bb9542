"""--log-format json on a real daemon, and SIGHUP: the level read again from the
config file, a bad value refused with the level kept, the daemon serving on;
every daemon's --log-file reopened after logrotate moved it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefs.testing.ports import free_port

KEYS = {"time", "level", "pid", "logger", "message", "component"}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(path: Path, message: str, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        records = _records(path)
        if any(message in r["message"] for r in records):
            return records
        assert time.monotonic() < deadline, f"no {message!r} in {path.read_text()}"
        time.sleep(0.05)


def test_a_daemon_logs_json_and_reloads_its_level_on_sighup(tmp_path: Path) -> None:
    config = tmp_path / "cachefs.toml"
    config.write_text('[datanode]\nlog-level = "INFO"\n')
    stderr = tmp_path / "datanode.log"
    with stderr.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cachefs.cli", "--config", str(config), "datanode", "--zone", "z1",
             "--data-dir", str(tmp_path / "data"), "--capacity", "1G", "--listen", f"127.0.0.1:{free_port()}",
             "--insecure", "--no-metrics", "--log-format", "json"],
            stdout=out, stderr=out, env={k: v for k, v in os.environ.items() if k != "CACHEFS_LOG_LEVEL"})
    try:
        records = _wait_for(stderr, "zone z1 serving")
        assert all(set(r) >= KEYS for r in records), records
        assert {r["component"] for r in records} == {"datanode"} and records[0]["pid"] == proc.pid
        assert records[0]["time"].endswith("+00:00") and records[0]["level"] == "INFO"
        config.write_text('[datanode]\nlog-level = "LOUD"\n')
        proc.send_signal(signal.SIGHUP)
        records = _wait_for(stderr, "keeping log level INFO")
        assert [r["level"] for r in records if "LOUD" in r["message"]] == ["ERROR"]
        config.write_text('[datanode]\nlog-level = "WARNING"\n')
        proc.send_signal(signal.SIGHUP)
        _wait_for(stderr, "SIGHUP: log level WARNING")
        assert proc.poll() is None  # SIGHUP did not end it
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code == 0
    # At WARNING now: the shutdown's INFO line is not logged.
    assert not [r for r in _records(stderr) if "shutting down" in r["message"]]


def test_every_daemon_and_the_mount_take_log_format() -> None:
    from cachefs.cli import _load

    for name in ("metanode", "datanode", "cachenode", "repair", "mount"):
        command = _load(name)
        [option] = [p for p in command.params if p.name == "log_format"]
        assert list(option.type.choices) == ["text", "json"] and option.default == "text", name


def _daemon_argv(kind: str, tmp_path: Path) -> list[str]:
    listen = ["--listen", f"127.0.0.1:{(port := free_port())}"]
    if kind == "metanode":
        return ["metanode", "--id", "1", "--peers", f"1=127.0.0.1:{port}", "--data-dir", str(tmp_path / "d"), *listen]
    if kind == "datanode":
        return ["datanode", "--zone", "z1", "--data-dir", str(tmp_path / "d"), "--capacity", "1G", *listen]
    if kind == "cachenode":
        return ["cachenode", "--zone", "z1", "--cache-dir", str(tmp_path / "d"), "--capacity", "64M",
                "--memory", "16M", *listen]
    (tmp_path / "cluster.json").write_text("{}")  # no volumes: one empty pass, then it waits
    return ["repair", "--cluster-file", str(tmp_path / "cluster.json"), "--interval", "3600"]


def _catches_sighup(pid: int) -> bool:
    """The process handles SIGHUP (trio's receiver is open): sending it now cannot kill it."""
    status = Path(f"/proc/{pid}/status").read_text()
    [caught] = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(caught, 16) & (1 << (signal.SIGHUP - 1)))


@pytest.mark.parametrize("kind", ["metanode", "datanode", "cachenode", "repair"])
def test_a_daemon_log_file_follows_logrotate(kind: str, tmp_path: Path) -> None:
    """--log-file: records (JSON here) and fds 1 and 2 (the interpreter's own
    tracebacks) go to the file; after logrotate moves it, SIGHUP moves all three
    to a new file at the old path, and nothing more lands in the rotated one."""
    log = tmp_path / f"{kind}.log"
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", *_daemon_argv(kind, tmp_path), "--insecure",
                             "--metrics-addr", str(free_port()), "--log-file", str(log), "--log-format", "json"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fds = [f"/proc/{proc.pid}/fd/{fd}" for fd in (1, 2)]
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and _catches_sighup(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text() if log.exists() else kind
            time.sleep(0.05)
        assert [os.readlink(fd) for fd in fds] == [str(log)] * 2
        rotated = log.rename(log.with_name(log.name + ".1"))
        proc.send_signal(signal.SIGHUP)
        while not (log.exists() and any("SIGHUP: log level INFO" in r["message"] for r in _records(log))):
            assert proc.poll() is None and time.monotonic() < deadline, rotated.read_text()
            time.sleep(0.05)
        assert [os.readlink(fd) for fd in fds] == [str(log)] * 2
        before = _records(rotated)  # JSON, every line of it
        assert {(r["component"], r["pid"]) for r in before} == {(kind, proc.pid)}
        assert any("metrics on" in r["message"] for r in before)
        assert not any("SIGHUP" in r["message"] for r in before)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
