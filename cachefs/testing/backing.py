"""Block storage in a dict, with the backing client's get/put/delete signatures.

For tests and benchmarks of the client that are about the client, not about
datanodes: the real :class:`~cachefs.backing.client.BackingClient` is tested
against real datanode processes in tests/backing.
"""

from __future__ import annotations

from typing import Any

from cachefs.errors import NotFound
from cachefs.ids import BlockKey


class DictBacking:
    """Blocks in memory, keyed by (volume, block key)."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, BlockKey], bytes] = {}

    async def put_block(self, volume: str, key: BlockKey, data: Any) -> list[Any]:
        self.blocks[(volume, key)] = bytes(data)
        return []  # never short

    async def get_block(self, volume: str, key: BlockKey, offset: int = 0, length: int = -1) -> bytes:
        data = self.blocks.get((volume, key))
        if data is None:
            raise NotFound(f"no block {key.hex()}")
        return data[offset:] if length < 0 else data[offset : offset + length]

    async def delete_block(self, volume: str, key: BlockKey) -> None:
        self.blocks.pop((volume, key), None)
