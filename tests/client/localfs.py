"""cachefs's FUSE client over an in-process metanode.

``python -m tests.client.localfs MOUNTPOINT`` mounts the real client (fs,
reader, writer, session, mount code) with two parts swapped for in-process
ones: the metanode is :mod:`cachefs.testing.metanode` (the real state
machine and service, reached over real RPC, one always-leading replica
instead of Raft), and blocks live in a dict. POSIX tests run against it in a
second process in well under a second per test; the same tests run against
a mount of a real cluster when one can be started (see conftest.py). At
unmount the namespace must pass its invariant check (an ERROR in the log
otherwise, which fails the test).
"""

from __future__ import annotations

import argparse
import logging
import sys

import trio

from cachefs.client.mount import run_fs
from cachefs.client.session import Session
from cachefs.client.volume import ClientOptions
from cachefs.queries import ClusterMap
from cachefs.rpc import RpcPool
from cachefs.testing.backing import DictBacking
from cachefs.testing.metanode import local_metanode
from cachefs.transport.tcp import TcpTransport

VOLUME = "vol"


async def main_async(mountpoint: str, block_size: int, options: ClientOptions) -> int:
    async with local_metanode() as metanode, RpcPool(secret=None) as pool:
        await metanode.create_volume(VOLUME, block_size=block_size)
        meta = metanode.client(pool, client_id="localfs")
        info = await meta.mount_volume(VOLUME)
        session = Session(
            meta,
            VOLUME,
            info.session,
            await meta.query(ClusterMap()),
            zone="",
            transport=TcpTransport(pool),
            backing=DictBacking(),  # type: ignore[arg-type]
        )

        def ready(error: str | None) -> None:
            print("ready" if error is None else f"error: {error}", flush=True)

        # allow_other: the POSIX tests check permissions as other users through this mount.
        status = await run_fs(session, mountpoint, options, ready, allow_other=True)
        try:
            metanode.check()  # fsck-style invariants of everything the mount did
        except AssertionError:
            logging.getLogger("localfs").exception("metadata invariants violated")
        return status


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mountpoint")
    parser.add_argument("--block-size", type=int, default=64 * 1024)
    parser.add_argument("--write-buffer", type=int, default=1 << 20)
    parser.add_argument("--l1", type=int, default=4 << 20)
    parser.add_argument("--compact-after", type=int, default=16)
    parser.add_argument("--read-only", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = ClientOptions(
        l1_bytes=args.l1,
        readahead_max=4 * args.block_size,
        write_buffer=args.write_buffer,
        attr_timeout=0.5,
        entry_timeout=0.5,
        read_only=args.read_only,
        compact_after=args.compact_after,
    )
    sys.exit(trio.run(main_async, args.mountpoint, args.block_size, options))


if __name__ == "__main__":
    main()
