"""Warm-up: slice lists to blocks (against a byte model), and prefetching a tree into real nodes."""

from __future__ import annotations

import random
import time
from pathlib import Path

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.blockstore import BlockStore
from cachefs.cachenode.admission import SecondMissAdmission
from cachefs.cachenode.service import CacheService
from cachefs.ids import BlockKey
from cachefs.layout import Slice
from cachefs.ring import CacheRouter
from cachefs.rpc import RpcServer
from cachefs.warming import WarmFile, file_blocks, warm_files

from .blockserver import RpcBlockSource, cache_setup

CS = 64  # a small chunk size keeps the byte model cheap


def _model(size: int, chunks: dict[int, list[list[int]]], bs: int) -> dict[BlockKey, int]:
    out: dict[BlockKey, int] = {}
    for p in range(size):
        chunk, pos = divmod(p, CS)
        for sid, spos, length, off in reversed(chunks.get(chunk, [])):
            if spos <= pos < spos + length:
                if sid:
                    key = BlockKey(sid, (off + pos - spos) // bs)
                    out[key] = out.get(key, 0) + 1
                break
    return out


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[int, dict[int, list[list[int]]], int]:
    size = draw(st.integers(0, 4 * CS))
    bs = draw(st.sampled_from([4, 8, 16, 64]))
    chunks: dict[int, list[list[int]]] = {}
    next_id = 1
    for c in range(-(-size // CS)):
        rows = []
        for _ in range(draw(st.integers(0, 5))):
            pos = draw(st.integers(0, CS - 1))
            length = draw(st.integers(1, CS - pos))
            off = draw(st.integers(0, 3 * bs))
            sid = 0 if draw(st.integers(0, 6)) == 0 else next_id  # id 0: an explicit hole
            next_id += 1
            rows.append([sid, pos, length, off])
        chunks[c] = rows
    return size, chunks, bs


@settings(max_examples=150, deadline=None)
@given(_layouts())
def test_file_blocks_matches_byte_model(layout) -> None:
    size, chunks, bs = layout
    slices = {c: [Slice(*row) for row in rows] for c, rows in chunks.items()}
    assert file_blocks(size, slices, bs, chunk_size=CS) == _model(size, chunks, bs)


def test_file_blocks_examples() -> None:
    MiB = 1 << 20
    # one 10 MiB slice: blocks 0, 1 (4 MiB each) and 2 (2 MiB)
    assert file_blocks(10 * MiB, {0: [Slice(7, 0, 10 * MiB, 0)]}, 4 * MiB) == {
        BlockKey(7, 0): 4 * MiB,
        BlockKey(7, 1): 4 * MiB,
        BlockKey(7, 2): 2 * MiB,
    }
    # a newer slice hides the middle of the old one; the file is shorter than the slice
    older, newer = Slice(7, 0, 10 * MiB, 0), Slice(8, 1 * MiB, 4 * MiB, 0)
    got = file_blocks(6 * MiB, {0: [older, newer]}, 4 * MiB)
    assert got == {BlockKey(7, 0): 1 * MiB, BlockKey(8, 0): 4 * MiB, BlockKey(7, 1): 1 * MiB}
    assert file_blocks(0, {}, 4 * MiB) == {}


async def test_warm_tree_then_reads_are_hits_and_rerun_is_cached(tmp_path: Path) -> None:
    bs = 64 * 1024
    rng = random.Random(11)
    files, blocks = [], {}
    for f in range(6):
        size = rng.randrange(1, 5 * bs)
        sid = 1000 + f
        layout = {0: [Slice(sid, 0, size, 0)]}
        for i in range(-(-size // bs)):
            blocks[BlockKey(sid, i)] = rng.randbytes(min(bs, size - i * bs))
        files.append(WarmFile(f"/data/f{f}", size, file_blocks(size, layout, bs)))
    nblocks = len(blocks)
    async with cache_setup(tmp_path / "a", blocks, admission=SecondMissAdmission()) as c:
        # a second cache node, in zone b, reading through the same backing server
        store_b = BlockStore.open(tmp_path / "b", 64 << 20)
        async with trio.open_nursery() as nursery:
            service_b = CacheService(
                store_b, RpcBlockSource(c.pool, c.backing_addr), nursery=nursery, node="b"
            )
            port = await nursery.start(
                RpcServer(service_b, name="cachenode", secret=None).serve, "127.0.0.1", 0
            )
            addr_b = f"127.0.0.1:{port}"
            cmap = {
                "epoch": 1,
                "cachenodes": [
                    {"id": "na", "addr": c.addr, "zone": "a", "capacity": 1, "state": "up"},
                    {"id": "nb", "addr": addr_b, "zone": "b", "capacity": 1, "state": "up"},
                ],
            }
            router = CacheRouter(cmap, "a")
            progressed: list[int] = []
            done_files: list[str] = []
            report = await warm_files(
                c.pool,
                router,
                "v",
                files,
                threads=3,
                batch=4,
                on_bytes=progressed.append,
                on_file=lambda w: done_files.append(w.path),
            )
            assert (report.blocks, report.fetched, report.cached, report.failed) == (
                2 * nblocks,
                2 * nblocks,
                0,
                0,
            )
            assert sum(progressed) == report.bytes == 2 * sum(f.size for f in files)
            assert sorted(done_files) == sorted(f.path for f in files)
            assert sum(c.backing.fetches.values()) == 2 * nblocks  # one per block per zone
            for addr in (c.addr, addr_b):
                for key, data in blocks.items():
                    reply = await c.pool.call(addr, "get", {"volume": "v", "key": key.to_bytes()})
                    assert reply.result["hit"] and bytes(reply.payload) == data
            assert not any(c.store.pinned(k) or store_b.pinned(k) for k in blocks)
            until = time.time() + 600
            again = await warm_files(c.pool, router, "v", files, threads=3, pin_until=until)
            assert again.already_warm and again.fetched == 0 and "already cached" in again.summary()
            assert all(c.store.pinned(k) == until == store_b.pinned(k) for k in blocks)  # cached ones too
            assert sum(c.backing.fetches.values()) == 2 * nblocks
            only_b = await warm_files(c.pool, router, "v", files, zones=["b"])
            assert only_b.blocks == nblocks and only_b.already_warm
            # a block backing storage does not have fails, and the report says so
            ghost = WarmFile("/data/ghost", 10, {BlockKey(77, 0): 10})
            bad = await warm_files(c.pool, router, "v", [ghost], zones=["a"])
            assert bad.failed == 1 and bad.errors and "1 failed" in bad.summary()
            nursery.cancel_scope.cancel()
