"""500 hostile sockets against each daemon kind (real processes): memory stays
bounded and real clients are served meanwhile (issue 14, item 7).

The hostile mix: the issue's probe (a 2-byte header claiming a 64 MiB payload,
sent before authenticating), sockets that never say a word, and sockets that
send half a handshake frame and stall. Before the fix the probe alone made a
daemon allocate 64 MiB per connection (40 of them: +2.5 GB).
"""

from __future__ import annotations

import os

import pytest
import trio

from cachefs import wire
from cachefs.rpc import RpcPool

HOSTILE = 500
# What 500 hostile sockets may cost a daemon at most, measured from /proc:
# pre-auth connections hold at most one handshake-sized frame each, and at
# most 32 of them (per peer address) at once.
RSS_BOUND = 16 << 20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


async def hostile(addr: str, kind: int, opened: list[int]) -> None:
    host, port = addr.rsplit(":", 1)
    try:
        stream = await trio.open_tcp_stream(host, int(port))
    except OSError:
        return  # the listen backlog overflowed: refused is fine too
    opened.append(1)
    try:
        with trio.move_on_after(6):
            if kind == 0:  # the probe: a frame prefix claiming 64 MiB
                await stream.send_all(wire.PREFIX.pack(2, 64 << 20) + b"\x91\x04")
            elif kind == 1:  # half of an Auth frame, then nothing
                frame = b"".join(bytes(b) for b in wire.encode(wire.Auth(os.urandom(32), "server:x", os.urandom(32))))
                await stream.send_all(frame[: len(frame) // 2])
            while await stream.receive_some(65536):  # kind 2: silent; all: wait to be dropped
                pass
    except (trio.BrokenResourceError, OSError):
        pass
    finally:
        await stream.aclose()


@pytest.mark.parametrize("kind", ["metanode", "datanode", "cachenode"])
def test_500_hostile_sockets_leave_memory_bounded_and_clients_served(small_lab, kind: str) -> None:
    node = small_lab.of_kind(kind)[0]
    addr = node.addr

    async def scenario():
        async with RpcPool(secret=small_lab.secret) as pool:
            await pool.call(addr, "health", timeout=10)  # an established client
            before = rss(node.pid)
            peak = before
            served: list[float] = []
            fresh: list[str] = []
            opened: list[int] = []

            async def client():
                for _ in range(40):
                    started = trio.current_time()
                    assert (await pool.call(addr, "health", timeout=10)).result["service"]
                    served.append(trio.current_time() - started)
                    await trio.sleep(0.05)

            async def fresh_client():
                # New connections while the hostile ones sit there.
                for _ in range(5):
                    await trio.sleep(0.3)
                    async with RpcPool(secret=small_lab.secret) as other:
                        fresh.append((await other.call(addr, "health", timeout=10)).result["service"])

            async def watch():
                nonlocal peak
                while True:
                    peak = max(peak, rss(node.pid))
                    await trio.sleep(0.02)

            async with trio.open_nursery() as n:
                n.start_soon(watch)
                async with trio.open_nursery() as attack:
                    for i in range(HOSTILE):
                        attack.start_soon(hostile, addr, i % 3, opened)
                    attack.start_soon(client)
                    attack.start_soon(fresh_client)
                n.cancel_scope.cancel()
            assert len(opened) >= HOSTILE * 0.9, len(opened)
            assert len(served) == 40 and max(served) < 2.0, served
            assert len(fresh) == 5
            assert peak - before < RSS_BOUND, f"{kind}: RSS grew by {(peak - before) >> 20} MiB"
            with trio.fail_after(10):  # every hostile connection is gone again
                while (await pool.call(addr, "health", timeout=5)).result["pending"]:
                    await trio.sleep(0.1)

    trio.run(scenario)
    assert node.pid and os.waitpid(node.pid, os.WNOHANG) == (0, 0)
