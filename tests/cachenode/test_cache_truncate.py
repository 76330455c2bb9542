"""Block files truncated by another process while the cache node serves them.

Large hits are served from a mapping of the block file; a file truncated
under a plain mapping would SIGBUS the node. The store maps only under a read
lease, so a truncating process waits for the mapping to go; a file found
short is corrupt, dropped and fetched again. Readers see correct bytes only.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from cachefs.blockstore import BlockStore
from cachefs.errors import Corrupt
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool

from .cacheproc import blocks

REPO = Path(__file__).resolve().parents[2]
SIZE = 2 << 20  # over the store's mmap_min: whole-block hits are mapped


@pytest.mark.allow_log("cachefs.blockstore", match=r"failed its checksum, dropped")
def test_truncating_process_waits_for_a_served_mapping(tmp_path: Path) -> None:
    store = BlockStore.open(tmp_path, 64 << 20, mmap_min=1)
    key = BlockKey(3, 1)
    data = random.Random(7).randbytes(SIZE)
    store.put("v", key, data)
    view = store.read(key)
    assert view is not None
    path = store.path(key)
    truncate = subprocess.Popen([sys.executable, "-c", f"import os; os.truncate({str(path)!r}, 100)"])
    try:
        if isinstance(view.obj, bytes):  # no lease on this filesystem: the read was a private copy
            assert truncate.wait(timeout=30) == 0
        else:
            time.sleep(0.3)
            assert truncate.poll() is None  # held off by the lease while the mapping lives
        assert bytes(view) == data  # what was verified is what is served
        view.release()
        del view
        assert truncate.wait(timeout=30) == 0
    finally:
        if truncate.poll() is None:
            truncate.kill()
            truncate.wait()
    assert path.stat().st_size == 100
    try:
        store.read(key)
        raise AssertionError("a truncated block file was served")
    except Corrupt:
        pass
    assert store.read(key) is None  # dropped: the next read is a miss


async def test_block_files_truncated_while_served(tmp_path: Path) -> None:
    count, readers, truncations, max_rounds = 4, 6, 24, 2000
    expected = blocks(count, SIZE)
    keys = list(expected)
    addr_file, cache_dir = tmp_path / "addr", tmp_path / "cache"
    node = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.cachenode.cacheproc", str(addr_file), str(cache_dir), str(count),
         str(SIZE)], cwd=REPO)
    try:
        with trio.fail_after(30):
            while not addr_file.exists():
                assert node.poll() is None, "the cache node process exited"
                await trio.sleep(0.05)
        addr = addr_file.read_text()
        async with RpcPool(secret=None) as pool:
            answer = await pool.call(addr, "prefetch", {"volume": "v", "keys": [k.to_bytes() for k in keys],
                                                        "wait": True}, timeout=60)
            assert answer.result["done"] == count
            store = BlockStore(cache_dir, 1)  # for file paths only
            truncated = 0
            done = trio.Event()

            async def read(key: BlockKey) -> None:
                reply = await pool.call(addr, "get", {"volume": "v", "key": key.to_bytes()}, timeout=60)
                assert reply.payload == expected[key]

            async def reader(i: int) -> None:
                # Reads go on while the truncator works: a truncation waits for
                # the mappings being served, and later replies release them.
                for r in range(max_rounds):
                    if done.is_set():
                        return
                    await read(keys[(i + r) % count])

            async def truncator() -> None:
                nonlocal truncated
                rng = random.Random(1)
                for _ in range(truncations):
                    path = store.path(rng.choice(keys))
                    try:
                        size = path.stat().st_size
                        await trio.to_thread.run_sync(os.truncate, path, rng.randrange(size))
                        truncated += 1
                    except FileNotFoundError:  # dropped and being fetched again
                        pass
                    await trio.sleep(0.005)
                done.set()

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for i in range(readers):
                        nursery.start_soon(reader, i)
                    nursery.start_soon(truncator)
            for key in keys:  # every block read again after the last truncation
                await read(key)
            stats = (await pool.call(addr, "stats")).result
        assert node.poll() is None, "the cache node died"
        assert truncated > 0 and stats["corrupt_refetched"] >= 1
        # Each refetch follows a corrupt read (concurrent readers may both see one file short).
        assert count < stats["backing_fetches"] <= count + stats["corrupt_refetched"]
    finally:
        node.kill()
        await node.wait()
