"""Checksums for stored and cached data: xxh3-64 (xxhash), fast and strong
enough to catch bit rot, torn writes and truncation; not a MAC."""

from __future__ import annotations

import xxhash

CHECKSUM_SIZE = 8


def checksum(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)
