"""/metrics is on by default: per-kind default ports, --metrics-addr, --no-metrics, the lab's ports."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cachefs.lab.cluster import Lab, LabConfig
from cachefs.metrics import DEFAULT_PORTS, MetricsAddr, parse_addr, start_metrics
from cachefs.testing.ports import free_port


def test_an_address_is_a_port_or_host_and_port(monkeypatch) -> None:
    monkeypatch.delenv("CACHEFS_METRICS_HOST", raising=False)
    assert parse_addr("9100") == MetricsAddr("127.0.0.1", 9100)
    assert parse_addr("0.0.0.0:9100", explicit=False) == MetricsAddr("0.0.0.0", 9100, explicit=False)
    assert parse_addr("[::1]:9100") == MetricsAddr("::1", 9100)
    monkeypatch.setenv("CACHEFS_METRICS_HOST", "0.0.0.0")
    assert parse_addr("9100").host == "0.0.0.0"
    for bad in ("", "x", "host:", "0", "70000", ":9100"):
        with pytest.raises(ValueError, match="not PORT or HOST:PORT"):
            parse_addr(bad)


def test_every_kind_has_its_own_default_port() -> None:
    assert len(set(DEFAULT_PORTS.values())) == len(DEFAULT_PORTS)


MINIMAL = {  # a command line of each kind that names no metrics option
    "metanode": ["--id", "1", "--peers", "1=127.0.0.1:7000", "--data-dir", "d"],
    "datanode": ["--zone", "z1", "--data-dir", "d", "--capacity", "1G"],
    "cachenode": ["--zone", "z1", "--cache-dir", "d", "--capacity", "1G"],
    "repair": ["--meta", "127.0.0.1:7000"],
    "mount": ["127.0.0.1:7000", "v", "mnt"],
}


@pytest.mark.parametrize("kind", sorted(DEFAULT_PORTS))
def test_every_daemon_and_the_mount_serve_metrics_by_default_at_their_port(kind: str, monkeypatch) -> None:
    from cachefs.testing.cliparse import parse_cachefs

    params = parse_cachefs(["cachefs", kind, *MINIMAL[kind]], {}, monkeypatch).params
    assert params["metrics_addr"] == MetricsAddr("127.0.0.1", DEFAULT_PORTS[kind], explicit=False)
    assert params["no_metrics"] is False
    params = parse_cachefs(["cachefs", kind, *MINIMAL[kind], "--no-metrics"], {}, monkeypatch).params
    assert params["no_metrics"] is True


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


@pytest.mark.allow_log("cachefs.metrics", "default port .* is taken")
def test_a_taken_default_port_falls_back_and_a_chosen_one_is_an_error() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        port = start_metrics(MetricsAddr("127.0.0.1", taken, explicit=False))
        assert port and port != taken
        assert "# HELP cachefs_rpc_calls_total" in _scrape(port)
        with pytest.raises(OSError, match=rf"cannot serve metrics on 127.0.0.1:{taken}"):
            start_metrics(MetricsAddr("127.0.0.1", taken))
    assert start_metrics(None) is None


def _metanode(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    port = free_port()
    log = tmp_path / f"meta-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "metanode", "--id", "1", "--peers",
                                 f"1=127.0.0.1:{port}", "--data-dir", str(tmp_path / f"d{port}"),
                                 "--listen", f"127.0.0.1:{port}", "--insecure", *extra],
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen[bytes]) -> re.Match[str]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        assert proc.poll() is None, log.read_text(errors="replace")
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in {log}: {log.read_text(errors='replace')}")


def test_a_daemon_serves_metrics_unless_told_not_to(tmp_path: Path) -> None:
    """No metrics option at all: the metanode serves /metrics (its default port,
    or the free one it fell back to, which it logs); --no-metrics: none."""
    on, on_log = _metanode(tmp_path)
    off, off_log = _metanode(tmp_path, "--no-metrics")
    try:
        found = _wait_for(on_log, r"metrics on http://127\.0\.0\.1:(\d+)/metrics", on)
        port = int(found.group(1))
        if "default port" not in on_log.read_text():
            assert port == DEFAULT_PORTS["metanode"]
        assert "# HELP cachefs_rpc_calls_total" in _scrape(port)
        deadline = time.monotonic() + 30
        while 'cachefs_raft_role{node="1",role="leader"} 1.0' not in (text := _scrape(port)):
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        assert 'cachefs_raft_role{node="1",role="follower"} 0.0' in text
        assert "cachefs_metanode_sessions 0.0" in text
        _wait_for(off_log, r"raft|leader|listening|serving", off)
        assert "metrics on" not in off_log.read_text()
    finally:
        for proc in (on, off):
            proc.terminate()
            proc.wait(timeout=20)


def test_the_lab_state_records_every_metrics_port(tmp_path: Path) -> None:
    lab = Lab(LabConfig(root=str(tmp_path / "lab"), base_port=21000))
    lab.save()
    state = json.loads((tmp_path / "lab" / "lab.json").read_text())
    ports = [n["metrics_port"] for n in state["nodes"]] + [state["mount_metrics_port"]]
    assert all(ports) and len(set(ports)) == len(ports)
    assert lab._mount_metrics() == ["--metrics-addr", str(state["mount_metrics_port"])]
    off = Lab(LabConfig(root=str(tmp_path / "off"), base_port=21000, metrics=False))
    assert off.config.mount_metrics_port == 0 and off._mount_metrics() == ["--no-metrics"]
    assert "--no-metrics" in off._argv(off.nodes[0])
