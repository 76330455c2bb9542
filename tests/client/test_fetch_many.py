"""A mount's batched fetch from a real cache node: replies land in a scratch
lent per call, and the blocks L1 keeps are copies that a later batch in the
same scratch cannot change."""

from __future__ import annotations

import mmap
import random
from pathlib import Path
from typing import Any

import trio

from cachefs.client.session import SCRATCH_KEEP, Session
from cachefs.errors import TimedOut
from cachefs.ids import BlockKey
from cachefs.transport.tcp import TcpTransport
from tests.cachenode.blockserver import cache_setup


def _blocks(first: int, n: int) -> dict[BlockKey, bytes]:
    rng = random.Random(first)
    return {BlockKey(300 + first + i, 0): rng.randbytes(rng.randrange(1, 200_000)) for i in range(n)}


async def test_batches_reuse_one_scratch_and_keep_their_own_bytes(tmp_path: Path) -> None:
    one, two = _blocks(0, 20), _blocks(100, 20)
    async with cache_setup(tmp_path, {}) as c:
        for key, data in {**one, **two}.items():
            await c.pool.call(c.addr, "put", {"volume": "v", "key": key.to_bytes()}, payload=data)
        session = Session(None, "v", "s", {}, zone="z1", transport=TcpTransport(c.pool), backing=None)  # type: ignore[arg-type]
        got_one = await session.fetch_many(c.addr, list(one))
        scratch = session._scratch._free[-1]
        assert bytes(scratch[:len(next(iter(one.values())))]) == next(iter(one.values()))  # it landed there
        got_two = await session.fetch_many(c.addr, list(two))
        assert session._scratch._free == [scratch]  # the same scratch, given back each time
        assert got_one == one and got_two == two  # the second batch overwrote the scratch, not the blocks
        assert all(type(v) is bytes for v in (*got_one.values(), *got_two.values()))

        # More batches in flight than scratches: the rest receive into their own buffers.
        batches = [_blocks(1000 + 50 * i, 8) for i in range(2 * SCRATCH_KEEP + 1)]
        for blocks in batches:
            for key, data in blocks.items():
                await c.pool.call(c.addr, "put", {"volume": "v", "key": key.to_bytes()}, payload=data)
        results: list[dict[BlockKey, bytes]] = [{} for _ in batches]

        async def fetch(i: int) -> None:
            results[i] = await session.fetch_many(c.addr, list(batches[i]))

        async with trio.open_nursery() as nursery:
            for i in range(len(batches)):
                nursery.start_soon(fetch, i)
        assert results == batches
        assert len(session._scratch._free) == SCRATCH_KEEP and session._scratch._lent == 0


async def test_a_failed_call_never_lends_its_scratch_again() -> None:
    late: list[bytearray] = []

    class Transport:  # the first call times out; its reply would still land in its scratch
        async def get_many(self, addr: str, volume: str, keys: list[BlockKey], *, timeout: float,
                           scratch: mmap.mmap | None = None) -> list[Any]:
            assert scratch is not None
            if not late:
                late.append(scratch)
                raise TimedOut("get_many to n passed its deadline")
            assert all(scratch is not s for s in late)
            scratch[:3] = b"abc"
            return [memoryview(scratch)[:3]]

    session = Session(None, "v", "s", {}, zone="z1", transport=Transport(), backing=None)  # type: ignore[arg-type]
    k = BlockKey(7, 0)
    assert await session.fetch_many("n", [k]) == {}  # read the usual way instead
    for _ in range(3):
        assert await session.fetch_many("n", [k]) == {k: b"abc"}
    assert session._scratch._lent == 0 and len(session._scratch._free) == 1
    assert session._scratch._free[0] is not late[0]
