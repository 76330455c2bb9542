"""Transport selection, RDMA fallback and the registered-buffer slot allocator.

The RDMA data path itself needs RDMA hardware; these machines have none (and
pyverbs' get_device_list() fails), which is exactly the fallback tested here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from cachefs.errors import InvalidArgument, NotFound
from cachefs.ids import BlockKey
from cachefs.rpc import Reply, RpcPool, RpcServer, rpc_method
from cachefs.transport import RdmaUnavailable, open_transport
from cachefs.transport.rdma import QpInfo, SlabAllocator, probe_device
from cachefs.transport.tcp import TcpTransport

SYSTEM_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")
SECRET = b"transport-test-secret"


def _has_pyverbs() -> bool:
    try:
        import pyverbs  # noqa: F401
    except ImportError:
        return False
    return True


class BlockService:
    """A real RPC service holding blocks in a dict, speaking the cache node's get/put."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}

    @rpc_method
    async def get(
        self, volume: str, key: bytes, offset: int = 0, length: int = -1, policy: str = "wait"
    ) -> Reply:
        data = self.blocks.get(volume.encode() + key)
        if data is None:
            raise NotFound(f"no block {BlockKey.from_bytes(key).hex()}")
        end = len(data) if length < 0 else offset + length
        return Reply({"size": len(data)}, payload=data[offset:end])

    @rpc_method
    async def put(self, volume: str, key: bytes, *, payload: memoryview) -> None:
        self.blocks[volume.encode() + key] = bytes(payload)


async def test_tcp_transport_round_trip(nursery) -> None:
    service = BlockService()
    server = RpcServer(service, name="blocks", secret=SECRET)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    addr = f"127.0.0.1:{port}"
    async with RpcPool(secret=SECRET) as pool:
        transport = open_transport("tcp", pool)
        assert isinstance(transport, TcpTransport)
        key = BlockKey(5, 2)
        data = os.urandom(100_000)
        await transport.put(addr, "vol", key, data)
        assert bytes(await transport.get(addr, "vol", key)) == data
        assert bytes(await transport.get(addr, "vol", key, 4096, 512)) == data[4096:4608]
        with pytest.raises(NotFound):
            await transport.get(addr, "vol", BlockKey(6, 0))
    await server.shutdown(grace=1.0)


async def test_unknown_mode_is_rejected() -> None:
    async with RpcPool(secret=None) as pool:
        with pytest.raises(InvalidArgument, match="tcp, rdma, auto"):
            open_transport("infiniband", pool)


@pytest.mark.skipif(
    _has_pyverbs(), reason="pyverbs importable here; covered by the subprocess test"
)
async def test_auto_falls_back_once_without_pyverbs(caplog) -> None:
    async with RpcPool(secret=None) as pool:
        with caplog.at_level(logging.WARNING, logger="cachefs.transport"):
            transport = open_transport("auto", pool)
        assert transport.name == "tcp"
        records = [r for r in caplog.records if "RDMA not available" in r.getMessage()]
        assert len(records) == 1
        assert "pyverbs is not installed" in records[0].getMessage()
        caplog.clear()
        with pytest.raises(RdmaUnavailable, match="pyverbs is not installed"):
            open_transport("rdma", pool)


PROBE = textwrap.dedent(
    """
    import logging, sys, trio
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    from cachefs.transport import RdmaUnavailable, open_transport
    from cachefs.rpc import RpcPool

    async def main():
        async with RpcPool(secret=None) as pool:
            print("auto ->", open_transport("auto", pool).name, flush=True)
            try:
                open_transport("rdma", pool)
            except RdmaUnavailable as exc:
                print("rdma ->", exc, flush=True)

    trio.run(main)
    """
)


@pytest.mark.skipif(
    not SYSTEM_PYVERBS.exists(), reason="the distribution's python3-pyverbs is not installed"
)
def test_real_pyverbs_without_device_falls_back() -> None:
    """With the real pyverbs (the system package) on a machine without RDMA:
    auto uses TCP and says why in one log line; rdma fails clearly."""
    env = dict(os.environ, PYTHONPATH=str(SYSTEM_PYVERBS.parent))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "auto -> tcp" in proc.stdout
    assert "rdma -> [EUNAVAIL] pyverbs could not list RDMA devices" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "Failed to get devices list" in warnings[0]


def test_probe_device_names_the_reason() -> None:
    with pytest.raises(RdmaUnavailable):
        probe_device()


async def test_slab_slots_are_exclusive_and_bounded() -> None:
    slab = SlabAllocator(slot_size=1024, count=3)
    assert slab.size == 3072 and slab.fits(1024) and not slab.fits(1025) and not slab.fits(0)
    in_use: set[int] = set()
    peak = 0

    async def user(i: int) -> None:
        nonlocal peak
        async with slab.slot() as (index, offset):
            assert index not in in_use and offset == index * 1024
            in_use.add(index)
            peak = max(peak, len(in_use))
            await trio.sleep(0.01 * (i % 3))
            in_use.discard(index)

    async with trio.open_nursery() as n:
        for i in range(12):
            n.start_soon(user, i)
    assert peak == 3 and slab.free == 3


async def test_slab_waiter_gets_a_freed_slot() -> None:
    slab = SlabAllocator(slot_size=8, count=1)
    got = trio.Event()

    async def second() -> None:
        async with slab.slot():
            got.set()

    async with trio.open_nursery() as n, slab.slot():
        n.start_soon(second)
        await trio.sleep(0.05)
        assert not got.is_set()  # backpressure: waits while the only slot is taken
    assert got.is_set()


def test_qp_info_validation() -> None:
    info = QpInfo(17, 99, 3, "fe80::1")
    assert QpInfo.from_wire(info.to_wire()) == info
    with pytest.raises(InvalidArgument, match="malformed RDMA"):
        QpInfo.from_wire({"qpn": "x"})
