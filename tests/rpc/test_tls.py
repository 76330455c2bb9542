"""Optional TLS on the wire, with a CA made by the test (trustme)."""

from __future__ import annotations

import os

import pytest
import trio
import trustme

from cachefs.errors import AuthFailed, CacheFSError
from cachefs.rpc import RpcPool, RpcServer, client_tls, server_tls

from .conftest import SECRET, EchoService


@pytest.fixture
def pki(tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "cert.pem", "key": tmp_path / "key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    other = trustme.CA()
    paths["other_ca"] = tmp_path / "other.pem"
    other.cert_pem.write_to_path(str(paths["other_ca"]))
    return {k: str(v) for k, v in paths.items()}


async def _tls_server(nursery, pki, service=None):
    server = RpcServer(service or EchoService(), name="tls", secret=SECRET, tls=server_tls(pki["cert"], pki["key"]))
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{port}"


async def test_calls_and_payloads_over_tls(nursery, pki):
    _, addr = await _tls_server(nursery, pki)
    data = os.urandom(3 << 20)
    async with RpcPool(secret=SECRET, tls=client_tls(pki["ca"])) as pool:
        reply = await pool.call(addr, "echo", {"value": 1}, payload=data)
        assert bytes(reply.payload) == data
        results = []

        async def one(i):
            results.append((await pool.call(addr, "echo", {"value": i})).result["value"])

        async with trio.open_nursery() as n:
            for i in range(100):
                n.start_soon(one, i)
    assert sorted(results) == list(range(100))


async def test_untrusted_server_certificate_is_refused(nursery, pki):
    _, addr = await _tls_server(nursery, pki)
    async with RpcPool(secret=SECRET, tls=client_tls(pki["other_ca"])) as pool:
        with pytest.raises(AuthFailed, match="TLS handshake"):
            await pool.call(addr, "echo")


@pytest.mark.allow_log("cachefs.rpc", match=r"sent no handshake")
async def test_plaintext_client_cannot_talk_to_a_tls_server(nursery, pki):
    server, addr = await _tls_server(nursery, pki)
    async with RpcPool(secret=SECRET) as pool:
        with pytest.raises(CacheFSError):
            await pool.call(addr, "echo", timeout=3)
    # ...and the server goes on serving TLS clients.
    async with RpcPool(secret=SECRET, tls=client_tls(pki["ca"])) as pool:
        assert (await pool.call(addr, "echo", {"value": 2})).result["value"] == 2


async def test_mutual_tls_requires_a_client_certificate(nursery, pki):
    ctx = server_tls(pki["cert"], pki["key"], client_ca_file=pki["ca"])
    server = RpcServer(EchoService(), name="mtls", secret=SECRET, tls=ctx)
    addr = f"127.0.0.1:{await nursery.start(server.serve, '127.0.0.1', 0)}"
    async with RpcPool(secret=SECRET, tls=client_tls(pki["ca"])) as pool:
        with pytest.raises(CacheFSError):
            await pool.call(addr, "echo", timeout=3)
    async with RpcPool(secret=SECRET, tls=client_tls(pki["ca"], pki["cert"], pki["key"])) as pool:
        assert (await pool.call(addr, "echo", {"value": 3})).result["value"] == 3


async def test_a_silent_tls_peer_is_dropped_without_hurting_the_pool(pki):
    """A call that times out with no byte back closes the socket at once;
    closing the TLS stream afterwards (close_notify on a closed socket) must
    not escape into the pool's nursery: it once killed a datanode at start-up."""
    from cachefs.errors import TimedOut

    service = EchoService()
    async with trio.open_nursery() as n:
        _, addr = await _tls_server(n, pki, service)
        async with RpcPool(secret=SECRET, tls=client_tls(pki["ca"])) as pool:
            first = await pool.connection(addr)
            with pytest.raises(TimedOut):
                await pool.call(addr, "freeze", timeout=0.5)
            assert first.closed
            assert (await pool.call(addr, "echo", {"value": 2})).result["value"] == 2
        service.thaw.set()
        n.cancel_scope.cancel()
