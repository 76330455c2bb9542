"""TLS between real daemons: a metanode and a datanode started with --tls-*.

The CA is made here with trustme; every node cert has the IP SAN 127.0.0.1.
Inside the cluster TLS is mutual, so the datanode registering with the
metanode proves its client side too; plain TCP, a client that trusts another
CA and a client without a certificate are all refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from click.testing import CliRunner

from cachefs.cli import main
from cachefs.errors import CacheFSError, TimedOut
from cachefs.rpc import Limits, RpcPool, client_tls
from cachefs.testing.ports import free_port

SECRET = b"tls-daemons-test-secret"
ROOT = Path(__file__).resolve().parents[2]


def _write_pki(ca: trustme.CA, d: Path, name: str) -> dict[str, str]:
    cert = ca.issue_cert("127.0.0.1")
    paths = {"cert": d / f"{name}-cert.pem", "key": d / f"{name}-key.pem", "ca": d / f"{name}-ca.pem"}
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    return {k: str(v) for k, v in paths.items()}


def _tls_args(pki: dict[str, str]) -> list[str]:
    return ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"]]


def _cli(*args: str) -> object:
    env = {"CACHEFS_SECRET": SECRET.decode()}
    return CliRunner(env=env).invoke(main, list(args), prog_name="cachefs")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    d = tmp_path_factory.mktemp("tls")
    pki = _write_pki(trustme.CA(), d, "node")
    other = _write_pki(trustme.CA(), d, "other")
    secret_file = d / "secret"
    secret_file.write_bytes(SECRET)
    meta = f"127.0.0.1:{free_port()}"
    data = f"127.0.0.1:{free_port()}"
    base = [sys.executable, "-m", "cachefs.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    logs = [open(d / "meta.log", "wb"), open(d / "data.log", "wb")]  # noqa: SIM115 - closed below
    procs = [subprocess.Popen(
        [*base, "metanode", "--id", "1", "--peers", f"1={meta}", "--data-dir", str(d / "meta"),
         "--secret-file", str(secret_file), "--log-level", "WARNING", *_tls_args(pki)],
        cwd=ROOT, env=env, stderr=logs[0])]
    # The datanode takes its TLS files from the environment, the other way to give them.
    tls_env = {"CACHEFS_TLS_CERT": pki["cert"], "CACHEFS_TLS_KEY": pki["key"], "CACHEFS_TLS_CA": pki["ca"]}
    procs.append(subprocess.Popen(
        [*base, "datanode", "--zone", "z1", "--data-dir", str(d / "data"), "--capacity", "64M",
         "--listen", data, "--meta", meta, "--heartbeat", "0.5", "--no-fsync",
         "--secret-file", str(secret_file), "--log-level", "WARNING"],
        cwd=ROOT, env=env | tls_env, stderr=logs[1]))
    try:
        yield {"meta": meta, "data": data, "pki": pki, "other": other, "dir": d, "procs": procs}
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for f in logs:
            f.close()


def _wait_healthy(cluster: dict, addr: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        for p in cluster["procs"]:
            if p.poll() is not None:
                logs = "".join((cluster["dir"] / n).read_text() for n in ("meta.log", "data.log"))
                pytest.fail(f"a daemon exited with {p.returncode}:\n{logs}")
        result = _cli("health", addr, "--timeout", "2", *_tls_args(cluster["pki"]))
        if result.exit_code == 0:
            return json.loads(result.output)
        if time.monotonic() > deadline:
            pytest.fail(f"{addr} not healthy over TLS within {timeout}s: {result.output}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def ready(cluster: dict) -> dict:
    """The cluster once both daemons answer health over TLS (a sync fixture: the CLI runs trio itself)."""
    _wait_healthy(cluster, cluster["meta"])
    _wait_healthy(cluster, cluster["data"])
    return cluster


def test_health_and_registration_over_mutual_tls(ready):
    cluster = ready
    # The datanode's own client (mutual TLS) registered it with the metanode.
    deadline = time.monotonic() + 30
    while True:
        result = _cli("status", "--meta", cluster["meta"], "--json", "--timeout", "5", *_tls_args(cluster["pki"]))
        if result.exit_code == 0:
            addrs = [n["addr"] for n in json.loads(result.output).get("datanodes", [])]
            if cluster["data"] in addrs:
                break
        assert time.monotonic() < deadline, f"datanode never registered over TLS: {result.output}"
        time.sleep(0.3)


async def test_plain_tcp_client_is_refused(ready):
    cluster = ready
    async with RpcPool(secret=SECRET, limits=Limits(handshake_timeout=1.0)) as pool:
        for addr in (cluster["meta"], cluster["data"]):
            # The server waits for a TLS ClientHello and never says hello in plain text.
            with pytest.raises(TimedOut, match="handshake"):
                await pool.call(addr, "health", timeout=2.0)


async def test_client_without_a_certificate_is_refused(ready):
    """Mutual TLS: trusting the right CA is not enough, the client must show a cert."""
    cluster = ready
    async with RpcPool(secret=SECRET, tls=client_tls(cluster["pki"]["ca"]),
                       limits=Limits(handshake_timeout=2.0)) as pool:
        with pytest.raises(CacheFSError, match="TLS"):  # the server's alert ends the stream
            await pool.call(cluster["data"], "health", timeout=2.0)


def test_client_trusting_another_ca_is_refused(ready):
    cluster = ready
    result = _cli("health", cluster["meta"], "--timeout", "2", *_tls_args(cluster["other"]))
    assert result.exit_code == 1
    assert "TLS handshake" in result.output and "unhealthy" in result.output


def test_partial_or_unreadable_tls_options_are_named(tmp_path, ready):
    cluster = ready
    pki = cluster["pki"]
    result = _cli("health", cluster["meta"], "--tls-cert", pki["cert"])
    assert result.exit_code == 2 and "missing --tls-key, --tls-ca" in result.output
    missing = str(tmp_path / "nope.pem")
    result = _cli("health", cluster["meta"], "--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", missing)
    assert result.exit_code == 2 and f"--tls-ca {missing}: No such file" in result.output
    not_pem = tmp_path / "junk.pem"
    not_pem.write_text("not a certificate\n")
    result = _cli("volume", "list", "--meta", cluster["meta"],
                  "--tls-cert", str(not_pem), "--tls-key", pki["key"], "--tls-ca", pki["ca"])
    assert result.exit_code == 2 and "TLS files" in result.output
