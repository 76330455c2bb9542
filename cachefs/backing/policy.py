"""A volume's storage policy: how its blocks are made redundant and compressed.

``ec:K+M`` cuts each block into K data shards plus M parity shards (any K of
the K+M rebuild the block); ``replica:N`` keeps N whole copies. Either way a
block occupies ``n`` placement slots, one per datanode of its placement group.

The write quorum follows DESIGN.md: a put is acknowledged only when one more
node failure would still lose nothing, i.e. K+1 shards (capped at K+M) or two
replicas (capped at N).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from cachefs.errors import InvalidArgument
from cachefs.ids import DEFAULT_BLOCK_SIZE

COMPRESSIONS = ("none", "zstd")
MAX_EC_WIDTH = 32  # liberasurecode/ISA-L limit on k + m
MAX_REPLICAS = 16
MIN_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = 64 * 1024 * 1024

_EC = re.compile(r"ec:(\d+)\+(\d+)")
_REPLICA = re.compile(r"replica:(\d+)")


@dataclass(frozen=True, slots=True)
class VolumePolicy:
    """Redundancy, compression and block size of one volume.

    For ``replica:N``, ``k`` is 1 and ``m`` is N-1, so ``n`` (the placement
    width) and "any ``m`` may be lost" read the same for both kinds.
    """

    kind: Literal["ec", "replica"]
    k: int
    m: int
    compression: str = "none"
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.kind not in ("ec", "replica"):
            raise InvalidArgument(f"policy kind must be 'ec' or 'replica', got {self.kind!r}")
        if self.kind == "ec":
            if self.k < 1 or self.m < 1:
                raise InvalidArgument(f"ec:{self.k}+{self.m}: K and M must both be at least 1")
            if self.k + self.m > MAX_EC_WIDTH:
                raise InvalidArgument(f"ec:{self.k}+{self.m}: K+M must be at most {MAX_EC_WIDTH}")
        else:
            if self.k != 1 or not 0 <= self.m < MAX_REPLICAS:
                raise InvalidArgument(f"replica:{self.m + 1}: N must be between 1 and {MAX_REPLICAS}")
        if self.compression not in COMPRESSIONS:
            raise InvalidArgument(
                f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}"
            )
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise InvalidArgument(
                f"block size must be between {MIN_BLOCK_SIZE} and {MAX_BLOCK_SIZE} bytes, "
                f"got {self.block_size}"
            )

    @classmethod
    def parse(
        cls, text: str, compression: str = "none", block_size: int = DEFAULT_BLOCK_SIZE
    ) -> VolumePolicy:
        """Parse ``"ec:K+M"`` or ``"replica:N"``; anything else is InvalidArgument."""
        if not isinstance(text, str):
            raise InvalidArgument(f"policy must be a string like 'ec:4+2' or 'replica:3', got {text!r}")
        spec = text.strip().lower()
        if match := _EC.fullmatch(spec):
            return cls("ec", int(match[1]), int(match[2]), compression, block_size)
        if match := _REPLICA.fullmatch(spec):
            n = int(match[1])
            if not 1 <= n <= MAX_REPLICAS:
                raise InvalidArgument(f"{text!r}: N must be between 1 and {MAX_REPLICAS}")
            return cls("replica", 1, n - 1, compression, block_size)
        raise InvalidArgument(f"bad policy {text!r}: expected 'ec:K+M' (e.g. ec:4+2) or 'replica:N'")

    @classmethod
    def from_volume(cls, volume: dict[str, Any]) -> VolumePolicy:
        """Build from a cluster-map volume entry (``{policy, compression, block_size}``)."""
        return cls.parse(
            volume["policy"],
            compression=volume.get("compression", "none"),
            block_size=int(volume.get("block_size", DEFAULT_BLOCK_SIZE)),
        )

    @property
    def n(self) -> int:
        """Shards (or replicas) per block: the placement group width."""
        return self.k + self.m

    @property
    def write_quorum(self) -> int:
        """Durable shards needed before a put is acknowledged."""
        if self.kind == "ec":
            return min(self.k + 1, self.n)
        return min(2, self.n)

    @property
    def compressed(self) -> bool:
        return self.compression == "zstd"

    def __str__(self) -> str:
        return f"ec:{self.k}+{self.m}" if self.kind == "ec" else f"replica:{self.n}"
