"""The test S3 server (real SeaweedFS) starts again on new ports when one of
the free ports it chose was taken before weed bound it: the race between
two test workers that failed six tests of a CI run ("bind: address already
in use", weed exit 255)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cachefs.testing import s3server
from cachefs.testing.s3server import SeaweedS3


def test_a_port_taken_before_weed_binds_it_is_a_retry_on_new_ports(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    taker = socket.socket()
    taker.bind(("127.0.0.1", 0))
    taker.listen()
    taken = taker.getsockname()[1]
    real = s3server.free_ports
    calls = []

    def first_one_taken(count: int) -> list[int]:
        ports = real(count)
        calls.append(ports)
        if len(calls) == 1:
            ports[5] = taken  # filer.port.grpc, the port of the CI failure
        return ports

    monkeypatch.setattr(s3server, "free_ports", first_one_taken)
    try:
        with SeaweedS3(tmp_path) as server:
            assert len(calls) == 2
            assert taken not in server.ports.values()
            assert server.ports["filer.port.grpc"] == calls[1][5]
        assert b"address already in use" in (tmp_path / "weed.log").read_bytes()
    finally:
        taker.close()


def test_weed_failing_for_another_reason_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = s3server.free_ports

    def counted(count: int) -> list[int]:
        calls.append(count)
        return real(count)

    monkeypatch.setattr(s3server, "free_ports", counted)
    monkeypatch.setattr(s3server, "weed_binary", lambda: "/bin/false")  # exits 1, binds nothing
    with pytest.raises(RuntimeError, match=r"weed exited \(1\)"):
        SeaweedS3(tmp_path).start(timeout=30)
    assert len(calls) == 1
