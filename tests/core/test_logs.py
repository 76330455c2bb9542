"""--log-format json on a real daemon, and SIGHUP: the level read again from the
config file, a bad value refused with the level kept, the daemon serving on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
