"""Cache node throughput against the bare RPC layer, in one run.

Cases, each with 1, 4 and 16 concurrent readers on one client connection:
(a) hits of whole 4 MiB blocks, MB/s; (b) hits of 128 KiB ranges at random
aligned offsets, ranges/s; (c) the same two through a bare RPC server that
answers ``get`` from one buffer in memory (no store, no checksum): the
baseline the cache should approach; (d) misses (read-through of blocks never
seen before from a backing server that serves from memory), MB/s; (e) the
latency of one 4 KiB hit at a time, as the client's block chain asks for it
(router, transport, connection), against one bare RPC round trip of 4 KiB in
the same run (the aim: at most 2x), with the client's and the server's CPU
per call.

The cache node, the bare server and the backing server each run in their own
process, so client and server get a core each. The cache directory is on the
local disk (page cache warm after the first touch, as a hot flash cache is).

    python -m bench.cache_bench [--json] [--repeat 3] [--seconds 1.5]

With ``BENCH_PROFILE=DIR`` in the environment the server processes run under
cProfile and leave ``DIR/<server>-<pid>.prof`` (read with ``python -m pstats``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import trio

from bench.common import emit, median, print_table, ratio, spawn, stop, wait_for_port
from cachefs.testing.ports import free_port

MiB = 1 << 20
BLOCK = 4 * MiB
RANGE = 128 * 1024
WARM_BLOCKS = 32
READERS = (1, 4, 16)


def _block_for(key: bytes) -> bytes:
    """Deterministic block contents without holding many blocks in memory."""
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


# ---------------------------------------------------------------- servers


def profiled(name: str, run: Callable[[], Any]) -> Any:
    """``run()``, under cProfile when ``BENCH_PROFILE`` names a directory.

    The stats (CPU time of the main thread) are written when ``run``
    returns or the process gets SIGTERM (what the bench's ``stop`` sends), as
    ``<name>-<pid>.prof``.
    """
    out = os.environ.get("BENCH_PROFILE")
    if not out:
        return run()
    import cProfile

    def interrupt(signum: int, frame: Any) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # trio turns SIGINT into a clean KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    prof = cProfile.Profile(time.thread_time)  # CPU time: wall time is noise on a shared machine
    prof.enable()
    try:
        return run()
    except BaseException as exc:
        if not _interrupted(exc):
            raise
        return None
    finally:
        prof.disable()
        prof.dump_stats(os.path.join(out, f"{name}-{os.getpid()}.prof"))


def _interrupted(exc: BaseException) -> bool:
    """A KeyboardInterrupt, or a group of nothing else (as trio's nurseries raise it)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_interrupted(e) for e in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


def serve_backing(port: int) -> None:
    """Backing storage stand-in: whole blocks from memory (the miss path's far end)."""
    from cachefs.rpc import Reply, RpcServer, rpc_method

    class Blocks:
        @rpc_method
        async def get_block(
            self, volume: str, key: bytes, offset: int = 0, length: int = -1
        ) -> Reply:
            return Reply({"size": BLOCK}, payload=_block_for(key))

    trio.run(lambda: RpcServer(Blocks(), name="backing", secret=None).serve("127.0.0.1", port))


def serve_bare(port: int) -> None:
    """The baseline: ``get`` answered from one buffer, no store, no checksums."""
    from cachefs.rpc import Reply, RpcServer, rpc_method

    data = memoryview(bytes(BLOCK))

    class Bare:
        @rpc_method
        async def get(
            self, volume: str, key: bytes, offset: int = 0, length: int = -1, policy: str = "wait"
        ) -> Reply:
            end = BLOCK if length == -1 else min(BLOCK, offset + length)
            return Reply({"size": BLOCK, "hit": True}, payload=data[offset:end])

    profiled("bare", lambda: trio.run(lambda: RpcServer(Bare(), name="bare", secret=None).serve("127.0.0.1", port)))


def serve_cache(
    port: int,
    backing_port: int,
    cache_dir: str,
    capacity: int,
    memory: int,
    inline: int,
    threads: int,
) -> None:
    from cachefs.backing.codec import keep_large_buffers
    from cachefs.blockstore import BlockStore
    from cachefs.cachenode.service import CacheLimits, CacheService
    from cachefs.ids import BlockKey
    from cachefs.rpc import RpcPool, RpcServer

    class Source:
        def __init__(self, pool: RpcPool) -> None:
            self.pool = pool

        async def get_block(self, volume: str, key: BlockKey) -> bytes:
            reply = await self.pool.call(
                f"127.0.0.1:{backing_port}", "get_block", {"volume": volume, "key": key.to_bytes()}
            )
            return reply.payload

    keep_large_buffers()  # as the cachenode daemon does

    async def main() -> None:
        store = BlockStore.open(cache_dir, capacity, memory_capacity=memory)
        async with trio.open_nursery() as nursery, RpcPool(secret=None) as pool:
            service = CacheService(
                store,
                Source(pool),
                nursery=nursery,
                node="bench",
                limits=CacheLimits(inline_read_max=inline, io_threads=threads),
            )
            await RpcServer(service, name="cachenode", secret=None).serve("127.0.0.1", port)

    profiled("cachenode", lambda: trio.run(main))


# ---------------------------------------------------------------- clients


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _key(i: int) -> bytes:
    from cachefs.ids import BlockKey

    return BlockKey(1 << 20 | i, 0).to_bytes()


async def warm(addr: str, keys: list[bytes]) -> None:
    from cachefs.rpc import RpcPool

    async with RpcPool(secret=None) as pool:
        answer = (
            await pool.call(
                addr, "prefetch", {"volume": "bench", "keys": keys, "wait": True}, timeout=120
            )
        ).result
        if answer.get("failed"):
            raise RuntimeError(f"warm-up failed: {answer}")


async def readers(
    addr: str, keys: list[bytes], n: int, seconds: float, length: int, fresh: bool = False
) -> tuple[float, float]:
    """(bytes/s, calls/s) of ``n`` concurrent readers on one connection."""
    from cachefs.rpc import RpcPool

    rng = random.Random(n)
    counter = [0]
    async with RpcPool(secret=None) as pool:
        # connect first, so the handshake is not timed
        await pool.call(addr, "get", {"volume": "bench", "key": keys[0], "offset": 0, "length": 1})
        moved = calls = 0
        deadline = time.perf_counter() + seconds

        async def reader() -> None:
            nonlocal moved, calls
            while time.perf_counter() < deadline:
                if fresh:
                    counter[0] += 1
                    key = _key(1_000_000 + counter[0] + n * 100_000)
                else:
                    key = rng.choice(keys)
                offset = 0 if length == -1 else rng.randrange(BLOCK // length) * length
                reply = await pool.call(
                    addr,
                    "get",
                    {"volume": "bench", "key": key, "offset": offset, "length": length},
                    timeout=60,
                )
                moved += len(reply.payload)
                calls += 1

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(reader)
        elapsed = time.perf_counter() - start
    return moved / elapsed, calls / elapsed


async def latency(
    addr: str, keys: list[bytes], calls: int, chain: bool, size: int = 4096
) -> tuple[float, float]:
    """(median µs, client CPU µs) per read of ``size`` bytes, one at a time: through
    the client's chain (``CacheRouter`` + ``TcpTransport``) or a bare ``pool.call``."""
    from cachefs.ids import BlockKey
    from cachefs.ring import CacheRouter
    from cachefs.rpc import RpcPool
    from cachefs.transport.tcp import TcpTransport

    rng = random.Random(7)
    cmap = {"cachenodes": [{"id": "c1", "addr": addr, "zone": "z1", "capacity": 1 << 30}]}
    router = CacheRouter(cmap, "z1")
    block_keys = [BlockKey.from_bytes(k) for k in keys]
    async with RpcPool(secret=None) as pool:
        transport = TcpTransport(pool)
        await pool.call(addr, "get", {"volume": "bench", "key": keys[0], "offset": 0, "length": 1})
        took = []
        cpu = time.thread_time()
        for _ in range(calls):
            i = rng.randrange(len(keys))
            offset = rng.randrange(BLOCK // size) * size
            start = time.perf_counter()
            if chain:
                [where] = router.candidates(block_keys[i])
                data = await transport.get(where, "bench", block_keys[i], offset, size)
            else:
                args = {"volume": "bench", "key": keys[i], "offset": offset, "length": size}
                data = (await pool.call(addr, "get", args)).payload
            took.append(time.perf_counter() - start)
            assert len(data) == size
        cpu = time.thread_time() - cpu
    return median(took) * 1e6, cpu / calls * 1e6


# ---------------------------------------------------------------- main


@contextlib.contextmanager
def _servers(memory: int, inline: int, threads: int) -> Iterator[tuple[list[subprocess.Popen], str, str, list[bytes]]]:
    """The backing, bare and cache servers, the cache warmed with ``WARM_BLOCKS`` blocks."""
    cache_port, bare_port, backing_port = free_port(), free_port(), free_port()
    cache_dir = tempfile.mkdtemp(prefix="cache-bench-", dir=os.environ.get("CACHE_BENCH_DIR"))
    servers = [
        spawn(["-m", "bench.cache_bench", "--serve-backing", str(backing_port)]),
        spawn(["-m", "bench.cache_bench", "--serve-bare", str(bare_port)]),
        spawn(
            [
                "-m",
                "bench.cache_bench",
                "--serve-cache",
                str(cache_port),
                "--backing-port",
                str(backing_port),
                "--dir",
                cache_dir,
                "--memory",
                str(memory),
                "--inline-read-max",
                str(inline),
                "--io-threads",
                str(threads),
            ]
        ),
    ]
    try:
        for port, proc in zip((backing_port, bare_port, cache_port), servers, strict=True):
            wait_for_port(port, proc=proc)
        cache, bare = f"127.0.0.1:{cache_port}", f"127.0.0.1:{bare_port}"
        keys = [_key(i) for i in range(WARM_BLOCKS)]
        trio.run(warm, cache, keys)
        yield servers, cache, bare, keys
    finally:
        for p in servers:
            stop(p)
        shutil.rmtree(cache_dir, ignore_errors=True)


def _latency_samples(
    servers: list[subprocess.Popen], cache: str, bare: str, keys: list[bytes], calls: int,
    sample: Callable[[str, float], None],
) -> None:  # fmt: skip
    for name, server, addr, chain in (("hit4k", servers[2], cache, True),
                                      ("rpc4k", servers[1], bare, False)):  # fmt: skip
        cpu = _cpu_seconds(server.pid)
        lat, client_cpu = trio.run(latency, addr, keys, calls, chain)
        sample(f"{name}_lat_us", lat)
        sample(f"{name}_client_cpu_us", client_cpu)
        sample(f"{name}_server_cpu_us", (_cpu_seconds(server.pid) - cpu) / calls * 1e6)


def hit_latency(repeat: int = 3, calls: int = 2000) -> dict[str, float]:
    """Case (e) alone, for ``bench.compare``: the 4 KiB hit against a bare round trip."""
    samples: dict[str, list[float]] = {}
    with _servers(0, 256 * 1024, 2) as (servers, cache, bare, keys):
        for _ in range(repeat):
            _latency_samples(servers, cache, bare, keys, calls,
                             lambda k, v: samples.setdefault(k, []).append(v))  # fmt: skip
    med = {k: round(median(v), 1) for k, v in samples.items()}
    return {**med, "cache_hit_4k_vs_rpc_latency": ratio(med["hit4k_lat_us"], med["rpc4k_lat_us"])}


def run(repeat: int, seconds: float, memory: int, inline: int, threads: int) -> dict:
    with _servers(memory, inline, threads) as (servers, cache, bare, keys):
        samples: dict[str, list[float]] = {}

        def sample(name: str, value: float) -> None:
            samples.setdefault(name, []).append(value)

        def timed(name: str, server: subprocess.Popen, addr: str, n: int, length: int) -> None:
            """Throughput, and the server's CPU time per call (robust on a busy machine)."""
            cpu = _cpu_seconds(server.pid)
            per_s, calls_per_s = trio.run(readers, addr, keys, n, seconds, length)
            sample(
                f"{name}_cpu_us", (_cpu_seconds(server.pid) - cpu) / (calls_per_s * seconds) * 1e6
            )
            sample(name, per_s / 1e6 if length == -1 else calls_per_s)

        for _ in range(repeat):
            for n in READERS:
                timed(f"hit4m_{n}", servers[2], cache, n, -1)
                timed(f"rpc4m_{n}", servers[1], bare, n, -1)
                timed(f"hit128k_{n}", servers[2], cache, n, RANGE)
                timed(f"rpc128k_{n}", servers[1], bare, n, RANGE)
            sample("miss4m_16", trio.run(readers, cache, keys, 16, seconds, -1, True)[0] / 1e6)
            _latency_samples(servers, cache, bare, keys, max(200, int(seconds * 2000)), sample)
        med = {k: median(v) for k, v in samples.items()}
    out: dict = {
        "repeat": repeat,
        "seconds": seconds,
        "memory_tier_bytes": memory,
        "inline_read_max": inline,
        "io_threads": threads,
    }
    for n in READERS:
        out[f"hit_4mib_mb_per_s_{n}"] = round(med[f"hit4m_{n}"], 1)
        out[f"rpc_4mib_mb_per_s_{n}"] = round(med[f"rpc4m_{n}"], 1)
        out[f"hit_128k_ranges_per_s_{n}"] = round(med[f"hit128k_{n}"])
        out[f"rpc_128k_ranges_per_s_{n}"] = round(med[f"rpc128k_{n}"])
    out["hit_4mib_ratio_vs_rpc"] = ratio(med["hit4m_16"], med["rpc4m_16"])
    out["hit_128k_ranges_per_s"] = round(med["hit128k_16"])
    out["hit_128k_ratio_vs_rpc"] = ratio(med["hit128k_16"], med["rpc128k_16"])
    out["miss_4mib_mb_per_s"] = round(med["miss4m_16"], 1)
    # Server CPU per call: what a hit costs beyond the bare RPC answer, whatever the load.
    out["hit_4mib_server_cpu_us"] = round(med["hit4m_16_cpu_us"])
    out["rpc_4mib_server_cpu_us"] = round(med["rpc4m_16_cpu_us"])
    out["hit_128k_server_cpu_us"] = round(med["hit128k_16_cpu_us"])
    out["rpc_128k_server_cpu_us"] = round(med["rpc128k_16_cpu_us"])
    for name in ("hit4k", "rpc4k"):
        for what in ("lat", "client_cpu", "server_cpu"):
            out[f"{name}_{what}_us"] = round(med[f"{name}_{what}_us"], 1)
    out["cache_hit_4k_vs_rpc_latency"] = ratio(med["hit4k_lat_us"], med["rpc4k_lat_us"])
    return out


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (median reported)")
    parser.add_argument("--seconds", type=float, default=1.5, help="duration of each run")
    parser.add_argument("--memory", type=int, default=0, help="cache node memory tier in bytes")
    parser.add_argument(
        "--inline-read-max",
        type=int,
        default=256 * 1024,
        help="reads up to this many bytes run on the event loop, larger ones in threads",
    )
    parser.add_argument(
        "--io-threads", type=int, default=2, help="worker threads for larger reads and writes"
    )
    parser.add_argument("--serve-backing", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-bare", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-cache", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backing-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_backing:
        return serve_backing(args.serve_backing)
    if args.serve_bare:
        return serve_bare(args.serve_bare)
    if args.serve_cache:
        return serve_cache(
            args.serve_cache,
            args.backing_port,
            args.dir,
            1 << 30,
            args.memory,
            args.inline_read_max,
            args.io_threads,
        )
    r = run(args.repeat, args.seconds, args.memory, args.inline_read_max, args.io_threads)

    def show() -> None:
        rows = []
        for n in READERS:
            rows.append(
                [
                    f"4 MiB hits MB/s, {n} readers",
                    r[f"hit_4mib_mb_per_s_{n}"],
                    r[f"rpc_4mib_mb_per_s_{n}"],
                    ratio(r[f"hit_4mib_mb_per_s_{n}"], r[f"rpc_4mib_mb_per_s_{n}"]),
                ]
            )
        for n in READERS:
            rows.append(
                [
                    f"128 KiB range hits/s, {n} readers",
                    r[f"hit_128k_ranges_per_s_{n}"],
                    r[f"rpc_128k_ranges_per_s_{n}"],
                    ratio(r[f"hit_128k_ranges_per_s_{n}"], r[f"rpc_128k_ranges_per_s_{n}"]),
                ]
            )
        rows.append(
            ["4 MiB misses (read-through) MB/s, 16 readers", r["miss_4mib_mb_per_s"], "", ""]
        )
        rows.append(
            [
                "server CPU us per 4 MiB hit, 16 readers",
                r["hit_4mib_server_cpu_us"],
                r["rpc_4mib_server_cpu_us"],
                ratio(r["hit_4mib_server_cpu_us"], r["rpc_4mib_server_cpu_us"]),
            ]
        )
        rows.append(
            [
                "server CPU us per 128 KiB hit, 16 readers",
                r["hit_128k_server_cpu_us"],
                r["rpc_128k_server_cpu_us"],
                ratio(r["hit_128k_server_cpu_us"], r["rpc_128k_server_cpu_us"]),
            ]
        )
        for what, label in (("lat", "latency"), ("client_cpu", "client CPU"),
                            ("server_cpu", "server CPU")):  # fmt: skip
            rows.append([f"4 KiB hit, one at a time: {label} us", r[f"hit4k_{what}_us"],
                         r[f"rpc4k_{what}_us"], ratio(r[f"hit4k_{what}_us"], r[f"rpc4k_{what}_us"])])  # fmt: skip
        print_table(
            f"Cache node vs bare RPC (medians of {r['repeat']} x {r['seconds']}s)",
            ["case", "cache node", "bare RPC", "cache/bare"],
            rows,
            note="bare RPC: a server answering get from one in-memory buffer; "
            "misses read through from a backing server serving from memory",
        )

    emit(r, args.json, show)
    return None


if __name__ == "__main__":
    sys.exit(main())
