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
from typing import Any

import trio

from cachefs.client.mount import run_fs
from cachefs.client.volume import ClientOptions
from cachefs.metrics import MetricsAddr
from cachefs.rpc import RpcPool
from cachefs.testing.backing import DictBacking
from cachefs.testing.metanode import local_metanode

VOLUME = "vol"


async def main_async(
    mountpoint: str, block_size: int, options: ClientOptions, metrics_port: int = 0
) -> int:
    async with local_metanode() as metanode, RpcPool(secret=None) as pool:
        await metanode.create_volume(VOLUME, block_size=block_size)
        session = await metanode.session(pool, VOLUME, client_id="localfs")

        def ready(error: str | None) -> None:
            print("ready" if error is None else f"error: {error}", flush=True)

        # allow_other: the POSIX tests check permissions as other users through this mount.
        metrics = MetricsAddr("127.0.0.1", metrics_port) if metrics_port else None
        status = await run_fs(session, mountpoint, options, ready, metrics, allow_other=True)
        try:
            metanode.check()  # fsck-style invariants of everything the mount did
        except AssertionError:
            logging.getLogger("localfs").exception("metadata invariants violated")
        return status


# ``--fail-once NAME``: the first call of this method raises RuntimeError,
# standing in for a bug in the background task that runs it (the code around
# it is the real client's).
FAIL_ONCE: dict[str, tuple[Any, ...]] = {
    "upload": (DictBacking, "put_block"),
    "compaction": ("cachefs.client.compaction", "Compactor", "compact"),
    "upkeep": ("cachefs.client.session", "Session", "heartbeat"),
    "idle-seal": ("cachefs.client.writer", "FileWriter", "seal_idle"),
    # Not the early read of a file's first block at open (that is read_early's).
    "readahead": ("cachefs.client.reader", "Reader", "_readahead", lambda _self, _inode, offset, _w: offset > 0),
    "early-read": ("cachefs.client.volume", "Volume", "read_early"),
}


def stall_uploads(after: int) -> None:
    real = DictBacking.put_block
    done = [0]

    async def put_block(self: DictBacking, volume: str, key: Any, data: Any) -> None:
        done[0] += 1
        if done[0] > after:
            await trio.sleep_forever()
        await real(self, volume, key, data)

    DictBacking.put_block = put_block  # type: ignore[method-assign]


def fail_once(name: str) -> None:
    import functools
    import importlib
    import inspect

    target = FAIL_ONCE[name]
    if isinstance(target[0], str):
        cls, method, *when = getattr(importlib.import_module(target[0]), target[1]), *target[2:]
    else:
        cls, method, *when = target
    real = getattr(cls, method)
    state = {"failed": False}

    def boom(*args: Any) -> None:
        if not state["failed"] and (not when or when[0](*args)):
            state["failed"] = True
            raise RuntimeError(f"injected failure in {cls.__name__}.{method}")

    if inspect.iscoroutinefunction(real):
        @functools.wraps(real)
        async def patched(*args: Any, **kwargs: Any) -> Any:
            boom(*args)
            return await real(*args, **kwargs)
    else:
        @functools.wraps(real)
        def patched(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            boom(*args)
            return real(*args, **kwargs)

    setattr(cls, method, patched)
    if name == "upkeep":  # the session's upkeep runs every MAP_REFRESH seconds
        import cachefs.client.session

        cachefs.client.session.MAP_REFRESH = 0.2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mountpoint")
    parser.add_argument("--block-size", type=int, default=64 * 1024)
    parser.add_argument("--write-buffer", type=int, default=1 << 20)
    parser.add_argument("--l1", type=int, default=4 << 20)
    parser.add_argument("--compact-after", type=int, default=16)
    parser.add_argument("--read-only", action="store_true")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--unmount-timeout", type=float, default=60.0)
    parser.add_argument("--spill-dir", default="")
    # Every block upload after the first N never finishes (a backing store
    # that stopped answering, with no deadline to save us).
    parser.add_argument("--stall-uploads-after", type=int, default=-1)
    parser.add_argument("--fail-once", action="append", default=[], choices=sorted(FAIL_ONCE))
    args = parser.parse_args(argv)
    for name in args.fail_once:
        fail_once(name)
    if args.stall_uploads_after >= 0:
        stall_uploads(args.stall_uploads_after)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = ClientOptions(
        l1_bytes=args.l1,
        readahead_max=4 * args.block_size,
        write_buffer=args.write_buffer,
        attr_timeout=0.5,
        entry_timeout=0.5,
        read_only=args.read_only,
        compact_after=args.compact_after,
        unmount_timeout=args.unmount_timeout,
        **({"spill_dir": args.spill_dir} if args.spill_dir else {}),
    )
    sys.exit(trio.run(main_async, args.mountpoint, args.block_size, options, args.metrics_port))


if __name__ == "__main__":
    main()
