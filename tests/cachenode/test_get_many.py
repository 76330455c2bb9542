"""The cache node's ``get_many``: hits from the store in one reply, misses
marked (never read through), a byte budget per reply, and hostile input."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefs.cachenode import service as cache_service
from cachefs.cachenode.service import MAX_GET_MANY, CacheService
from cachefs.errors import CacheFSError, InvalidArgument
from cachefs.ids import BlockKey
from cachefs.messages import MANY_MISS, MANY_NOT_SERVED, BlockBatch

from .blockserver import CacheSetup, cache_setup

SIZE = 110 * 1024 + 5


def _blocks(n: int, size: int = SIZE) -> dict[BlockKey, bytes]:
    rng = random.Random(n)
    return {BlockKey(200 + i, 0): rng.randbytes(size) for i in range(n)}


async def _get_many(c: CacheSetup, keys: list[BlockKey]) -> list[Any]:
    reply = await c.pool.call(c.addr, "get_many", {"volume": "v", "keys": [k.to_bytes() for k in keys]})
    payload = reply.payload if reply.payload is not None else b""
    return BlockBatch.from_wire(reply.result, len(keys), len(payload)).split(payload)


async def _cache(c: CacheSetup, blocks: dict[BlockKey, bytes]) -> None:
    for key, data in blocks.items():
        await c.pool.call(c.addr, "put", {"volume": "v", "key": key.to_bytes()}, payload=data)


async def test_hits_come_in_one_reply_and_misses_are_marked_not_fetched(tmp_path: Path) -> None:
    blocks = _blocks(6)
    cached = dict(list(blocks.items())[:4])
    async with cache_setup(tmp_path, blocks, memory=SIZE) as c:  # one in memory, the rest on flash
        await _cache(c, cached)
        keys = list(blocks)
        got = await _get_many(c, keys)
        for key, item in zip(keys, got, strict=True):
            if key in cached:
                assert bytes(item) == blocks[key]
            else:
                assert item == MANY_MISS
        assert sum(c.backing.fetches.values()) == 0  # no read-through
        stats = (await c.pool.call(c.addr, "stats")).result
        assert stats["get_many"] == 1 and stats["get_many_blocks"] == 4
        assert await _get_many(c, []) == []


async def test_a_reply_stops_at_its_byte_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = _blocks(5)
    monkeypatch.setattr(cache_service, "GET_MANY_BYTES", 2 * SIZE + 10)
    async with cache_setup(tmp_path, blocks) as c:
        await _cache(c, blocks)
        keys = list(blocks)
        got = await _get_many(c, keys)
        assert [bytes(g) for g in got[:2]] == [blocks[k] for k in keys[:2]]
        assert got[2:] == [MANY_NOT_SERVED] * 3
        got = await _get_many(c, keys[2:])  # asked again: served
        assert [bytes(g) for g in got[:2]] == [blocks[k] for k in keys[2:4]]


@pytest.mark.allow_log("cachefs.blockstore", match=r"failed its checksum, dropped")
async def test_a_corrupt_block_is_a_miss(tmp_path: Path) -> None:
    blocks = _blocks(2)
    async with cache_setup(tmp_path, blocks) as c:
        await _cache(c, blocks)
        bad = next(iter(blocks))
        path = c.store.path(bad)
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF
        path.write_bytes(bytes(raw))
        got = await _get_many(c, list(blocks))
        assert got[0] == MANY_MISS and bytes(got[1]) == blocks[list(blocks)[1]]


def _only_on_disk(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.allow_log("cachefs.blockstore", match=r"failed its checksum, dropped")
async def test_blocks_on_the_disk_are_read_in_one_thread_job_per_io_thread(tmp_path: Path) -> None:
    """Blocks the page cache does not hold cost ``io_threads`` thread hops
    per batch, not one each; every byte is still checked, and a block
    found corrupt on the disk is a miss."""
    blocks = _blocks(7)
    keys = list(blocks)
    async with cache_setup(tmp_path, blocks, memory=SIZE) as c:
        await _cache(c, blocks)
        bad = keys[3]
        raw = bytearray(c.store.path(bad).read_bytes())
        raw[-100] ^= 0xFF
        c.store.path(bad).write_bytes(bytes(raw))
        for key in keys:
            _only_on_disk(c.store.path(key))
        jobs: list[int] = []
        read_blocks = c.service._read_blocks

        def spy(keys: list[BlockKey]) -> list[Any]:
            jobs.append(len(keys))
            return read_blocks(keys)

        c.service._read_blocks = spy  # type: ignore[method-assign]
        got = await _get_many(c, keys + [BlockKey(999, 0)])
        for key, item in zip(keys, got, strict=False):
            assert item == MANY_MISS if key == bad else bytes(item) == blocks[key]
        assert got[-1] == MANY_MISS
        assert 1 <= len(jobs) <= c.service.limits.io_threads and sum(jobs) <= len(keys)
        stats = (await c.pool.call(c.addr, "stats")).result
        assert stats["corrupt_refetched"] == 1 and stats["get_many_blocks"] == len(keys) - 1


async def test_a_failed_disk_read_fails_the_batch_with_its_typed_error(tmp_path: Path) -> None:
    """A read error in a worker thread (here: the block's file replaced by
    a directory, so pread fails with EISDIR) answers the batch with
    IOFailure, as an inline read error does, not as an internal error; the
    node goes on serving."""
    blocks = _blocks(3, size=300 * 1024)  # above inline_read_max: straight to the worker threads
    keys = list(blocks)
    async with cache_setup(tmp_path, blocks) as c:
        await _cache(c, blocks)
        path = c.store.path(keys[1])
        path.unlink()
        path.mkdir()
        with pytest.raises(CacheFSError) as failed:
            await _get_many(c, keys)
        assert type(failed.value).__name__ == "IOFailure" and keys[1].hex() in str(failed.value)
        got = await _get_many(c, [keys[0], keys[2]])
        assert [bytes(g) for g in got] == [blocks[keys[0]], blocks[keys[2]]]


async def test_too_many_keys_is_refused_naming_the_limit(tmp_path: Path) -> None:
    async with cache_setup(tmp_path, {}) as c:
        keys = [BlockKey(1, i).to_bytes() for i in range(MAX_GET_MANY + 1)]
        with pytest.raises(InvalidArgument, match=f"at most {MAX_GET_MANY}"):
            await c.pool.call(c.addr, "get_many", {"volume": "v", "keys": keys})


def test_the_same_roles_may_call_get_many_as_get() -> None:
    assert CacheService.get_many.__rpc_roles__ == CacheService.get.__rpc_roles__  # type: ignore[attr-defined]


def test_a_malformed_reply_is_refused_at_the_edge() -> None:
    assert BlockBatch.from_wire([[3, -1, -2]], 3, 3).split(b"abc")[1:] == [MANY_MISS, MANY_NOT_SERVED]
    for raw, asked, n in [([[3, -1]], 3, 3), ([[3]], 1, 4), ([[-3]], 1, 0), ([["3"]], 1, 3), ({}, 0, 0),
                          ([[1.0]], 1, 1), (None, 0, 0)]:
        with pytest.raises(CacheFSError):
            BlockBatch.from_wire(raw, asked, n)


KEY = st.one_of(
    st.sampled_from([b"", b"\x00" * 12, b"\xff" * 12, b"\x00" * 4096]),
    st.builds(lambda s, i: BlockKey(s, i).to_bytes(), st.integers(0, 2**63 - 1), st.integers(0, 15)),
    st.binary(max_size=40),
)
ANY = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
                st.binary(max_size=16))
VOLUME = st.one_of(st.sampled_from(["v", "", "x" * 300, "other", "a\x00b"]), ANY)
KEYS = st.one_of(
    st.lists(KEY, max_size=MAX_GET_MANY + 8),
    st.lists(st.one_of(KEY, ANY), max_size=8),
    ANY,
    st.dictionaries(st.text(max_size=4), KEY, max_size=3),
)
CALLS = st.lists(st.fixed_dictionaries({"volume": VOLUME, "keys": KEYS}), min_size=1, max_size=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=CALLS)
def test_hostile_get_many_never_hurts_the_node(calls: list[dict[str, Any]]) -> None:
    """Typed hostile arguments: each call gets an answer or a clear error
    (never a crash or a closed connection), and the node then still serves
    a good batch."""
    blocks = _blocks(2)

    async def main() -> None:
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            async with cache_setup(Path(tmp), blocks) as c:
                await _cache(c, blocks)
                for args in calls:
                    try:
                        reply = await c.pool.call(c.addr, "get_many", args, timeout=10)
                    except InvalidArgument as exc:
                        assert exc.message
                        continue
                    keys = args["keys"]
                    payload = reply.payload if reply.payload is not None else b""
                    got = BlockBatch.from_wire(reply.result, len(keys), len(payload)).split(payload)
                    for raw, item in zip(keys, got, strict=True):
                        data = blocks.get(BlockKey.from_bytes(raw))
                        assert (bytes(item) == data) if data is not None else item == MANY_MISS
                got = await _get_many(c, list(blocks))
                assert [bytes(g) for g in got] == list(blocks.values())
                assert sum(c.backing.fetches.values()) == 0

    trio.run(main)
