"""Shard puts coalesced per datanode (:mod:`cachefs.backing.put_batches`), against real datanodes.

What runs here: many blocks put at once go to each datanode in fewer calls
than shards and all read back; one bad shard in a ``put_many`` fails alone;
a datanode without ``put_many`` (an older version: a real RPC server that
serves only ``put``) gets plain puts; and ``parse``, the datanode's check
of a call's shape, refuses typed hostile shapes with an error that names
the shard, never anything else.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from cachefs.backing import put_batches
from cachefs.backing.client import BackingClient
from cachefs.backing.policy import VolumePolicy
from cachefs.backing.put_batches import PutCoalescer
from cachefs.credentials import CLIENTS
from cachefs.errors import InvalidArgument, NoSuchMethod
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool, RpcServer, rpc_method
from cachefs.testing.datanodes import SECRET, Datanodes

_slices = iter(range(1 << 41, 1 << 42))


def new_key() -> BlockKey:
    return BlockKey(next(_slices), 0)


async def test_blocks_put_at_once_share_calls_and_read_back(cluster: Datanodes, volume: str) -> None:
    pol = VolumePolicy.parse("ec:4+2", block_size=1 << 20)
    view = cluster.view({volume: pol})
    rng = random.Random(7)
    blocks = {new_key(): rng.randbytes(rng.randrange(1, 40_000)) for _ in range(48)}
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        async with trio.open_nursery() as n:
            for key, data in blocks.items():
                n.start_soon(client.put_block, volume, key, data)
        stats = client.puts.stats
        assert stats["plain"] + stats["coalesced"] == 48 * 6
        assert stats["calls"] > 0 and stats["coalesced"] > stats["calls"]  # several shards per call
        assert not client.missing
        for key, data in blocks.items():
            assert await client.get_block(volume, key) == data


async def test_a_bad_shard_in_a_batch_fails_alone(cluster: Datanodes, volume: str) -> None:
    good, bad = new_key(), new_key()
    async with RpcPool(secret=SECRET) as pool:
        addr = cluster.addr(0)
        reply = await pool.call(addr, "put_many", {"volume": volume, "shards": [
            [good.to_bytes(), 0, b"meta", 5], [b"not a key", 0, b"", 3], [good.to_bytes(), 1, b"x" * 5000, 2],
        ]}, payload=b"hello" + b"abc" + b"zz")
        first, second, third = reply.result["results"]
        assert first is None
        assert second[0] == "EINVAL"
        assert third[0] == "EINVAL" and "meta" in third[1]
        got = await pool.call(addr, "get", {"volume": volume, "key": good.to_bytes(), "index": 0})
        assert bytes(got.payload) == b"hello" and got.result["meta"] == b"meta"
        with pytest.raises(InvalidArgument, match="at most 64"):
            await pool.call(addr, "put_many", {"volume": volume, "shards": [[bad.to_bytes(), 0, b"", 0]] * 65})
        with pytest.raises(InvalidArgument, match="shard 0 ends at byte 9 of a 2-byte payload"):
            await pool.call(addr, "put_many", {"volume": volume, "shards": [[bad.to_bytes(), 0, b"", 9]]},
                            payload=b"zz")


class _OldDatanode:
    """A datanode of a version before put_many: it serves put alone."""

    def __init__(self) -> None:
        self.stored: dict[tuple[bytes, int], bytes] = {}

    @rpc_method(roles=CLIENTS)
    async def put(self, volume: str, key: bytes, index: int, meta: bytes = b"", payload: Any = None) -> dict:
        await trio.sleep(0.01)  # long enough for the next puts to queue behind it
        self.stored[(key, index)] = bytes(payload)
        return {"size": len(payload)}


async def test_a_datanode_without_put_many_gets_plain_puts() -> None:
    old = _OldDatanode()
    async with trio.open_nursery() as n:
        server = RpcServer(old, name="old-datanode", secret=SECRET)
        addr = f"127.0.0.1:{await n.start(server.serve, '127.0.0.1', 0)}"
        async with RpcPool(secret=SECRET) as pool:
            puts = PutCoalescer(pool.call)
            shards = {(os.urandom(12), i): os.urandom(100) for i in range(10)}
            async with trio.open_nursery() as inner:
                for (key, index), data in shards.items():
                    inner.start_soon(lambda k=key, i=index, d=data: puts.put(addr, "v", k, i, b"", d, timeout=5))
            assert old.stored == shards
            assert puts.stats["plain"] == 10 and puts.stats["calls"] == 0
            assert addr in puts._plain_only
            with pytest.raises(NoSuchMethod):
                await pool.call(addr, "put_many", {"volume": "v", "shards": []})
        n.cancel_scope.cancel()


shard_entry = st.one_of(
    st.tuples(st.binary(max_size=20), st.integers(-5, 5), st.binary(max_size=8), st.integers(-3, 50)).map(list),
    st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=4), st.binary(max_size=4)), max_size=6),
    st.one_of(st.none(), st.integers(), st.text(max_size=4), st.dictionaries(st.text(max_size=3), st.integers())),
)


@given(shards=st.lists(shard_entry, max_size=70), payload=st.one_of(st.none(), st.binary(max_size=120)))
def test_parse_takes_a_well_formed_call_and_names_what_is_wrong_with_any_other(shards: list, payload: Any) -> None:
    try:
        parsed = put_batches.parse(shards, payload)
    except InvalidArgument as exc:
        assert str(exc.message).startswith("put_many: ")
        return
    assert 1 <= len(parsed) <= put_batches.MAX_SHARDS
    assert b"".join(bytes(p[3]) for p in parsed) == (payload or b"")
    for (key, index, meta, data), entry in zip(parsed, shards, strict=True):
        assert [key, index, meta, len(data)] == list(entry)
