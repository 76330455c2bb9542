"""Identifiers shared by every part: block keys and their encodings.

A block is named by ``(slice_id, index)`` (see DESIGN.md, "Data model").
Slice ids are allocated cluster-wide by the metanodes and never reused, so a
key names the same bytes forever: a cached block can never be stale.

Slice ids with :data:`REPO_SLICE_BIT` set are a key space of their own: each
names one version (ETag) of one object of a linked S3 bucket (see
:mod:`cachefs.repo`), allocated when that version is imported, so
``BlockKey(repo slice, i)`` is block ``i`` of exactly that object version and
a changed object gets new keys. Their blocks live in the bucket, never on the
datanodes; the cache tier treats them like any other immutable block.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

_KEY = struct.Struct(">QI")

CHUNK_SIZE = 64 * 1024 * 1024
DEFAULT_BLOCK_SIZE = 4 * 1024 * 1024
REPO_SLICE_BIT = 1 << 63


def is_repo_slice(slice_id: int) -> bool:
    """Whether ``slice_id`` names an imported object version (its blocks are in S3)."""
    return slice_id >= REPO_SLICE_BIT


class BlockKey(NamedTuple):
    slice_id: int
    index: int

    def to_bytes(self) -> bytes:
        return _KEY.pack(self.slice_id, self.index)

    @classmethod
    def from_bytes(cls, raw: bytes) -> BlockKey:
        if len(raw) != _KEY.size:
            raise ValueError(f"block key must be {_KEY.size} bytes, got {len(raw)}")
        return cls(*_KEY.unpack(raw))

    def hex(self) -> str:
        """Stable text form, used for file names and hash-ring keys."""
        return f"{self.slice_id:016x}-{self.index:08x}"

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        slice_hex, _, index_hex = text.partition("-")
        if len(slice_hex) != 16 or len(index_hex) != 8:
            raise ValueError(f"not a block key: {text!r}")
        return cls(int(slice_hex, 16), int(index_hex, 16))
