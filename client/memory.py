"""The most memory a mount may hold, part by part (docs/deploy.md, "Memory of a mount").

A mount's resident size is its fixed overhead plus what its budgets let it
hold: L1, the write buffers, and a bounded number of things in flight. Each
budget is a limit the code enforces (a semaphore, a byte budget, a capped
pool or worker count); the metadata kept per inode and lease is counted at
a measured cost per object, and what no budget covers (RPC state, small
objects) is taken not to grow with traffic beyond the heap slack. The
mount exports the parts and their sum (``cachefs_mount_memory_bound_bytes``),
and the soak test (tests/client/test_memory.py) holds its resident size to
that sum, which checks those assumptions.

The parts:

- ``fixed``: the resident size when the mount began serving (interpreter,
  libraries, connections; 50-55 MiB, documented as at most ``FIXED_MAX``);
- ``l1``: ``--l1-size``;
- ``write_buffers``: ``--write-buffer-total`` (runs upload from their own buffers);
- ``uploads``: ``upload_parallel`` blocks in flight, each with the codec's
  copy, its compressed form (zstd volumes) and its shards (EC; replicas send
  one buffer N times);
- ``compaction``: one chunk for the whole mount (``Compactor``);
- ``fetches``: readahead's ``PREFETCH_PARALLEL`` blocks, and two blocks per
  FUSE worker (a read of up to 1 MiB spans at most two); a fetched block
  goes into L1, so this counts the blocks L1 let go of while a reply or a
  readahead still held them;
- ``fuse_buffers``: libfuse's receive buffer (max_write and a header) per
  pyfuse3 worker task. pyfuse3 starts a worker per concurrent request and
  keeps each buffer while the worker lives, so ``--fuse-workers`` caps them
  (pyfuse3's own cap is 99);
- ``reuse_pool``: the block buffers kept for reuse (``buffers.KEEP``);
- ``scratch``: the receive scratches of batched fetches
  (``session.SCRATCH_KEEP`` of ``messages.GET_MANY_BYTES``; resident only
  as far as replies have filled them);
- ``heap_slack``: what the heap trimmer lets grow before it gives freed
  pages back (``heap.TRIM_SLACK``);
- ``l2``: the L2 fill queue (``l2.FILL_QUEUE`` blocks) and its index, per block cached;
- ``metadata``: the inodes the kernel holds, the ghosts that keep their
  slice lists, and the leases, each at its measured size.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachefs.backing.policy import VolumePolicy
from cachefs.buffers import KEEP
from cachefs.heap import TRIM_SLACK
from cachefs.ids import CHUNK_SIZE
from cachefs.messages import GET_MANY_BYTES

from .l2 import FILL_QUEUE
from .reader import PREFETCH_PARALLEL
from .session import SCRATCH_KEEP

FIXED_MAX = 64 << 20  # the most a mount holds when it begins serving (documented)
FUSE_BUFFER = (1 << 20) + 4096  # libfuse's receive buffer: max_write (1 MiB) and a header
# Measured with tracemalloc (Python 3.11), rounded up:
INODE = 1536  # an inode in the table, with one chunk's slice list (725 bytes bare)
LEASE = 1024  # a lease with its attributes (944 bytes)
L2_ENTRY = 3072  # an L2 index entry of a 4 MiB block: 256 segment checksums, packed (2,520 bytes measured)


def upload_factor(policy: VolumePolicy | None) -> float:
    """Bytes one block upload holds, per byte of block: the codec's copy,
    its compressed form and its EC shards (see ``Codec.encode``). Without a
    policy, the widest EC layout compressed."""
    if policy is None:
        return 2 + 2.0  # a copy, compressed, and shards of up to twice the data
    shards = policy.n / policy.k if policy.kind == "ec" else 0.0
    return 1 + (1 if policy.compressed else 0) + shards


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """The static parts of a mount's bound; :meth:`parts` adds the counted ones."""

    fixed: int
    l1: int
    write_buffers: int
    block_size: int
    upload_parallel: int
    upload_factor: float
    fuse_workers: int
    l2: bool = False

    def parts(self, *, inodes: int, ghosts: int, leases: int, l2_blocks: int = 0) -> dict[str, int]:
        """Every part of the bound in bytes, with the counts of what the mount
        holds now (inodes in the table, ghosts, leases, blocks in L2)."""
        block = self.block_size
        return {
            "fixed": self.fixed,
            "l1": self.l1,
            "write_buffers": self.write_buffers,
            "uploads": int(self.upload_parallel * block * self.upload_factor),
            "compaction": CHUNK_SIZE,
            "fetches": (PREFETCH_PARALLEL + 2 * self.fuse_workers) * block,
            "fuse_buffers": self.fuse_workers * FUSE_BUFFER,
            "reuse_pool": KEEP * block,
            "scratch": SCRATCH_KEEP * GET_MANY_BYTES,
            "heap_slack": TRIM_SLACK,
            "l2": (FILL_QUEUE * block + l2_blocks * L2_ENTRY) if self.l2 else 0,
            "metadata": (inodes + ghosts) * INODE + leases * LEASE,
        }
