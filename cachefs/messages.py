"""Typed replies of the metanodes, shared by every part that reads them.

A reply is a frozen class validated when it is decoded (``from_wire``): a
malformed answer from a metanode becomes an ``IOFailure`` at the edge, never
a half-built object deeper in.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import Any

from cachefs.errors import IOFailure

ATTR_FIELDS = (
    "ino",
    "mode",
    "uid",
    "gid",
    "nlink",
    "size",
    "atime_ns",
    "mtime_ns",
    "ctime_ns",
    "rdev",
    "generation",
    "version",
)

@dataclass(frozen=True, slots=True)
class Attr:
    """Inode attributes as the metanodes send them (see docs/contracts.md)."""

    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0
    generation: int = 0
    version: int = 0

    @classmethod
    def from_wire(cls, raw: Any) -> Attr:
        if not isinstance(raw, dict):
            raise IOFailure(f"metanode sent attributes as {type(raw).__name__}")
        try:
            return cls(**{name: int(raw.get(name, 0)) for name in ATTR_FIELDS})
        except (TypeError, ValueError) as exc:
            raise IOFailure(f"malformed attributes from metanode: {exc}") from None

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    def with_size(self, size: int) -> Attr:
        return Attr(**{**{n: getattr(self, n) for n in ATTR_FIELDS}, "size": size})
