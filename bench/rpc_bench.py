"""RPC layer throughput against a bare trio stream echo, in one run.

Cases: (a) small calls/s on one connection with 1 and 64 in flight;
(b) MB/s of 1 MiB and 4 MiB payload echo with 1 and 8 in flight;
(c) the same bytes through a bare trio TCP echo (no framing, no msgpack) on
one connection, and the ratio RPC/bare. Servers run in their own process so
client and server each get a core.

    python -m bench.rpc_bench [--json] [--repeat 3] [--seconds 1.5]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import trio

from bench.common import emit, median, print_table, ratio, spawn, stop, wait_for_port
from cachefs.testing.ports import free_port

SECRET = b"bench-secret"
MiB = 1 << 20


# ---------------------------------------------------------------- servers

def serve_rpc(port: int) -> None:
    from cachefs.rpc import Reply, RpcServer, rpc_method

    class Echo:
        @rpc_method
        async def echo(self, v: int = 0, *, payload: memoryview | None = None) -> Reply:
            return Reply(v, payload)

    async def main() -> None:
        await RpcServer(Echo(), name="bench", secret=SECRET).serve("127.0.0.1", port)

    trio.run(main)


def serve_bare(port: int) -> None:
    async def echo(stream: trio.SocketStream) -> None:
        try:
            while data := await stream.receive_some(4 * MiB):
                await stream.send_all(data)
        except trio.BrokenResourceError:
            pass

    trio.run(functools.partial(trio.serve_tcp, echo, port, host="127.0.0.1"))


# ---------------------------------------------------------------- clients

async def rpc_small(addr: str, inflight: int, seconds: float) -> float:
    from cachefs.rpc import RpcPool

    async with RpcPool(secret=SECRET) as pool:
        await pool.call(addr, "echo")
        count = 0
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal count
            while time.perf_counter() < deadline:
                await pool.call(addr, "echo", {"v": count})
                count += 1

        start = time.perf_counter()
        async with trio.open_nursery() as n:
            for _ in range(inflight):
                n.start_soon(worker)
        return count / (time.perf_counter() - start)


async def rpc_payload(addr: str, size: int, inflight: int, seconds: float) -> float:
    """MB/s of payload bytes sent (and echoed back)."""
    from cachefs.rpc import RpcPool

    data = bytes(size)
    async with RpcPool(secret=SECRET) as pool:
        await pool.call(addr, "echo", payload=data)
        moved = 0
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal moved
            while time.perf_counter() < deadline:
                reply = await pool.call(addr, "echo", payload=data)
                assert len(reply.payload) == size
                moved += size

        start = time.perf_counter()
        async with trio.open_nursery() as n:
            for _ in range(inflight):
                n.start_soon(worker)
        return moved / (time.perf_counter() - start) / 1e6


async def bare_payload(port: int, size: int, seconds: float) -> float:
    """MB/s of a bare echo stream: write ``size`` buffers, read them back."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    data = bytes(size)
    sent = received = 0
    done = False
    start = time.perf_counter()
    deadline = start + seconds

    async def sender() -> None:
        nonlocal sent, done
        while time.perf_counter() < deadline:
            await stream.send_all(data)
            sent += size
        done = True

    async def receiver() -> None:
        nonlocal received
        while not done or received < sent:
            chunk = await stream.receive_some(4 * MiB)
            received += len(chunk)

    async with trio.open_nursery() as n:
        n.start_soon(sender)
        n.start_soon(receiver)
    elapsed = time.perf_counter() - start
    await stream.aclose()
    return received / elapsed / 1e6


# ---------------------------------------------------------------- main

def run(repeat: int, seconds: float) -> dict:
    rpc_port, bare_port = free_port(), free_port()
    servers = [spawn(["-m", "bench.rpc_bench", "--serve-rpc", str(rpc_port)]),
               spawn(["-m", "bench.rpc_bench", "--serve-bare", str(bare_port)])]
    try:
        wait_for_port(rpc_port, proc=servers[0])
        wait_for_port(bare_port, proc=servers[1])
        addr = f"127.0.0.1:{rpc_port}"
        samples: dict[str, list[float]] = {}

        def sample(name: str, fn, *args) -> None:
            samples.setdefault(name, []).append(trio.run(fn, *args))

        for _ in range(repeat):
            for inflight in (1, 64):
                sample(f"small_{inflight}", rpc_small, addr, inflight, seconds)
            for size in (1 * MiB, 4 * MiB):
                for inflight in (1, 8):
                    sample(f"rpc_{size // MiB}m_{inflight}", rpc_payload, addr, size, inflight, seconds)
                sample(f"bare_{size // MiB}m", bare_payload, bare_port, size, seconds)
        med = {k: median(v) for k, v in samples.items()}
    finally:
        for p in servers:
            stop(p)
    return {
        "repeat": repeat,
        "small_calls_per_s_inflight1": round(med["small_1"]),
        "small_calls_per_s_inflight64": round(med["small_64"]),
        "payload_1mib_mb_per_s_inflight1": round(med["rpc_1m_1"], 1),
        "payload_1mib_mb_per_s_inflight8": round(med["rpc_1m_8"], 1),
        "payload_4mib_mb_per_s_inflight1": round(med["rpc_4m_1"], 1),
        "payload_4mib_mb_per_s_inflight8": round(med["rpc_4m_8"], 1),
        "bare_1mib_mb_per_s": round(med["bare_1m"], 1),
        "bare_4mib_mb_per_s": round(med["bare_4m"], 1),
        "payload_1mib_ratio_vs_bare": ratio(max(med["rpc_1m_1"], med["rpc_1m_8"]), med["bare_1m"]),
        "payload_4mib_ratio_vs_bare": ratio(max(med["rpc_4m_1"], med["rpc_4m_8"]), med["bare_4m"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (median reported)")
    parser.add_argument("--seconds", type=float, default=1.5, help="duration of each run")
    parser.add_argument("--serve-rpc", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-bare", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_rpc:
        return serve_rpc(args.serve_rpc)
    if args.serve_bare:
        return serve_bare(args.serve_bare)
    r = run(args.repeat, args.seconds)

    def show() -> None:
        print_table(f"RPC layer vs bare trio stream (medians of {r['repeat']})",
                    ["case", "RPC", "bare trio", "RPC/bare"], [
                        ["small calls/s, 1 in flight", r["small_calls_per_s_inflight1"], "", ""],
                        ["small calls/s, 64 in flight", r["small_calls_per_s_inflight64"], "", ""],
                        ["1 MiB echo MB/s, 1 in flight", r["payload_1mib_mb_per_s_inflight1"], r["bare_1mib_mb_per_s"], ""],
                        ["1 MiB echo MB/s, 8 in flight", r["payload_1mib_mb_per_s_inflight8"], r["bare_1mib_mb_per_s"],
                         r["payload_1mib_ratio_vs_bare"]],
                        ["4 MiB echo MB/s, 1 in flight", r["payload_4mib_mb_per_s_inflight1"], r["bare_4mib_mb_per_s"], ""],
                        ["4 MiB echo MB/s, 8 in flight", r["payload_4mib_mb_per_s_inflight8"], r["bare_4mib_mb_per_s"],
                         r["payload_4mib_ratio_vs_bare"]],
                    ], note="bare: one trio TCP stream echoing the same buffers; ratio uses RPC's better in-flight case")

    emit(r, args.json, show)


if __name__ == "__main__":
    sys.exit(main())
