"""A volume's metadata backup (``cachefs dump`` / ``cachefs load``).

The file is ``MAGIC``, a 2-byte big-endian format version, then one zstd
frame of msgpack: ``[volume spec, placement groups, next_slice, slice_floor,
volume row]``, the row as the Raft snapshot keeps a volume (``snapshot.py``),
so a backup is as exact as a snapshot. Only metadata: the blocks stay on the
datanodes, so a load must go to a cluster with the same datanodes (the
placement groups name them) and no volume yet, whose slice counter then
starts ``SLICE_GAP`` past every slice the backup names.

The leader serializes a backup in a forked child (``raft/snapshot_child.py``),
which sees the state exactly as it was at one applied index while writers go
on: a consistent snapshot that stops no one.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import msgpack
import zstandard

from cachefs import commands as C
from cachefs.errors import CacheFSError, Exists, InvalidArgument, NotFound

from .clustermap import VolumeSpec
from .namespace import MetaState, Volume
from .snapshot import load_volume, volume_row

MAGIC = b"CACHEFS-META-DUMP\n"
VERSION = 1
_HEADER = struct.Struct(">H")
MAX_BACKUP = 8 << 30  # decompressed bytes
# slice ids skipped at a load: more than a cluster allocates between a dump and a wipe
SLICE_GAP = 1 << 40


@dataclasses.dataclass(slots=True)
class Backup:
    spec: VolumeSpec
    pgs: list[list[str]]
    next_slice: int
    slice_floor: int
    volume: Volume


def check_dumpable(state: MetaState, name: str) -> None:
    """Raise what :func:`dump_volume` would refuse ``name`` for."""
    if name not in state.volumes:
        raise NotFound(f"no volume {name!r}")
    linked = sorted(link.id for link in state.links.values() if link.volume == name)
    if linked:  # their files' slices live in state.repo_objects, which a backup does not carry yet
        raise InvalidArgument(
            f"volume {name!r} has data repository links ({linked}): dump cannot back them up yet"
        )


def dump_volume(state: MetaState, name: str) -> bytes:
    """The backup file's bytes for volume ``name`` as ``state`` holds it now."""
    check_dumpable(state, name)
    vol = state.volumes[name]
    spec = state.cluster.volumes[name]
    body = [
        spec.row(),
        state.cluster.pgs.get(name, []),
        state.next_slice,
        state.slice_floor,
        volume_row(vol),
    ]
    raw = msgpack.packb(body, use_bin_type=True)
    return (
        MAGIC
        + _HEADER.pack(VERSION)
        + zstandard.ZstdCompressor(level=3, write_checksum=True).compress(raw)
    )


def parse(data: bytes, what: str = "backup") -> Backup:
    """Decode a backup; InvalidArgument naming what is wrong with it (``what``
    names the file in the message)."""
    data = bytes(data)
    if not data.startswith(MAGIC):
        raise InvalidArgument(f"{what} is not a cachefs metadata dump (no {MAGIC!r} magic)")
    head = data[len(MAGIC) : len(MAGIC) + _HEADER.size]
    if len(head) < _HEADER.size:
        raise InvalidArgument(f"{what} is truncated: it ends inside the header")
    (version,) = _HEADER.unpack(head)
    if version != VERSION:
        raise InvalidArgument(
            f"{what} is dump format version {version}; this cachefs reads version {VERSION}"
        )
    try:
        raw = _decompress(data[len(MAGIC) + _HEADER.size :], what)
        spec, pgs, next_slice, slice_floor, row = msgpack.unpackb(
            raw, raw=False, strict_map_key=False
        )
        backup = Backup(
            VolumeSpec(*spec),
            [list(pg) for pg in pgs],
            int(next_slice),
            int(slice_floor),
            load_volume(row),
        )
    except CacheFSError:
        raise
    except zstandard.ZstdError as exc:
        raise InvalidArgument(f"{what} is truncated or corrupt (zstd: {exc})") from None
    except Exception as exc:  # a hostile body: any shape msgpack can hold
        raise InvalidArgument(f"{what} is corrupt: {type(exc).__name__}: {exc}") from None
    spec = backup.spec
    try:  # the checks a volume creation makes, on the name and the spec
        C.CreateVolume(
            backup.volume.name, spec.policy, spec.compression, spec.block_size, spec.pg_count,
            backing=spec.backing, backing_endpoint=spec.endpoint, backing_region=spec.region,
        )
    except CacheFSError as exc:
        raise InvalidArgument(f"{what} is corrupt: {exc.message}") from None
    misfit = any(
        len(pg) != spec.width or not all(isinstance(n, str) for n in pg) for pg in backup.pgs
    )
    if misfit or backup.pgs and len(backup.pgs) != spec.pg_count:  # none: it had no datanodes
        raise InvalidArgument(
            f"{what} is corrupt: its placement groups do not fit {spec.pg_count} x {spec.width}"
        )
    if 1 not in backup.volume.inodes or not backup.volume.inodes[1].is_dir:
        raise InvalidArgument(f"{what} is corrupt: the volume has no root directory")
    return backup


def _decompress(body: bytes, what: str) -> bytes:
    """The zstd frame's content, fed in small pieces: a hostile frame makes
    no allocation larger than what it really decodes to (the one-shot call
    trusts the frame's content size), and one that stops short is refused."""
    dobj = zstandard.ZstdDecompressor().decompressobj()
    out = bytearray()
    for k in range(0, len(body), 1024):  # 1 KiB in: at most ~32 MiB out per step
        out += dobj.decompress(body[k : k + 1024])
        if len(out) > MAX_BACKUP:
            raise InvalidArgument(f"{what} decompresses to over {MAX_BACKUP} bytes")
    if not dobj.eof:
        raise InvalidArgument(f"{what} is truncated: its zstd frame does not end")
    return bytes(out)


def restore(state: MetaState, backup: Backup) -> dict[str, Any]:
    """Install ``backup`` into an empty cluster's ``state`` (a log apply:
    deterministic). Refuses a cluster that holds a volume, and placement
    groups naming datanodes the cluster does not know."""
    if state.volumes:
        names = ", ".join(sorted(state.volumes))
        raise Exists(
            f"the cluster is not empty (volumes: {names}): load restores into a cluster without volumes"
        )
    name = backup.volume.name
    known = set(state.cluster.datanodes)
    missing = sorted({n for pg in backup.pgs for n in pg} - known)
    if missing:
        raise NotFound(
            f"the dump's blocks are on datanodes this cluster lacks: {', '.join(missing)}"
        )
    state.cluster.pgs[name] = [list(pg) for pg in backup.pgs]  # kept: _place starts from them
    state.cluster.add_volume(name, backup.spec)
    state.volumes[name] = backup.volume
    # Blocks written after the dump was taken are on the datanodes under ids
    # from backup.next_slice on: new slices start far past them, and the floor
    # rises there, so no commit can reuse such an id and gc may collect them.
    start = max(state.next_slice, backup.next_slice) + SLICE_GAP
    state.next_slice = start
    state.slice_floor = max(state.slice_floor, start)
    return {
        "volume": name,
        "inodes": len(backup.volume.inodes),
        "used_bytes": backup.volume.used_bytes,
    }
