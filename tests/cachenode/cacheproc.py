"""A cache node and its in-memory backing source in a process of their own.

For tests that must see the node survive what happens to its files (a crash
would take the whole pytest process down if it ran in-process). Writes the
node's address to ``ADDR_FILE`` once it serves; runs until killed.

    python -m tests.cachenode.cacheproc ADDR_FILE CACHE_DIR BLOCKS SIZE
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import trio

from cachefs.ids import BlockKey

from .blockserver import cache_setup


def blocks(count: int, size: int) -> dict[BlockKey, bytes]:
    rng = random.Random(count * size)
    return {BlockKey(900 + i, i): rng.randbytes(size) for i in range(count)}


async def serve(addr_file: Path, cache_dir: Path, count: int, size: int) -> None:
    async with cache_setup(cache_dir, blocks(count, size), capacity=4 * count * size) as setup:
        tmp = addr_file.with_suffix(".tmp")
        tmp.write_text(setup.addr)
        tmp.rename(addr_file)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(serve, Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
