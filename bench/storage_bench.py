"""Backing storage throughput, against the RPC layer's bare payload rate, in one run.

Cases:
(a) ISA-L (pyeclib ``isa_l_rs_vand``) ec:4+2 encode and decode (2 data shards
    lost) of 4 MiB blocks, MB/s on one core, in this process;
(b) put and get MB/s of 4 MiB blocks to 6 local datanode processes (3 zones)
    under ec:4+2 and replica:3, with 1 and 8 blocks in flight;
(c) a degraded ec:4+2 get: 2 of the 6 datanodes marked down, so every
    block is decoded from parity;
(d) the baseline: 4 MiB payloads fetched over the RPC layer from one server
    process that returns a prepared buffer (no disk, no coding), 8 in flight.
``ec_get_ratio_vs_rpc`` is (b) ec:4+2 get with 8 in flight over (d).

    python -m bench.storage_bench [--json] [--repeat 3] [--seconds 1.5]

With ``BENCH_PROFILE=DIR`` in the environment the datanodes and the baseline
server run under cProfile (CPU time) and leave ``DIR/<server>-<pid>.prof``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import trio

from bench.cache_bench import profiled
from bench.common import emit, median, print_table, ratio, spawn, stop, wait_for_port
from cachefs.testing.ports import free_port

SECRET = b"bench-secret"
MiB = 1 << 20
BLOCK = 4 * MiB
ZONES = ["a", "a", "b", "b", "c", "c"]
BLOCKS_PER_POLICY = 16


# ---------------------------------------------------------------- baseline server

def serve_blob(port: int) -> None:
    from cachefs.rpc import Reply, RpcServer, rpc_method

    blob = os.urandom(BLOCK)

    class Blob:
        @rpc_method
        async def get(self, size: int = BLOCK) -> Reply:
            return Reply({"size": size}, payload=memoryview(blob)[:size])

    async def main() -> None:
        await RpcServer(Blob(), name="bench", secret=SECRET).serve("127.0.0.1", port)

    profiled("blob", lambda: trio.run(main))


def serve_datanode(argv: list[str]) -> None:
    """``cachefs datanode ARGV`` in this process, profiled under BENCH_PROFILE."""
    from cachefs.datanode.daemon import command

    profiled("datanode", lambda: command.main(argv, standalone_mode=False))


# ---------------------------------------------------------------- codec

def codec_rates(seconds: float) -> tuple[float, float]:
    """(encode, degraded decode) MB/s of ec:4+2 on 4 MiB blocks, one core."""
    from cachefs.backing.codec import Codec
    from cachefs.backing.policy import VolumePolicy

    codec = Codec(VolumePolicy.parse("ec:4+2"))
    data = os.urandom(BLOCK)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        header, shards = codec.encode(data)
        count += 1
    encode = count * BLOCK / (time.perf_counter() - start) / 1e6
    survivors = {i: s for i, s in enumerate(shards) if i not in (0, 2)}
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        assert len(codec.decode(header, survivors)) == BLOCK
        count += 1
    decode = count * BLOCK / (time.perf_counter() - start) / 1e6
    return encode, decode


# ---------------------------------------------------------------- cluster cases

async def _loop(inflight: int, seconds: float, op) -> float:
    moved = 0
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal moved
        n = 0
        while time.perf_counter() < deadline:
            done = await op(w, n)  # not `moved += await ...`: that reads `moved` before the await
            moved += done
            n += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for w in range(inflight):
            nursery.start_soon(worker, w)
    return moved / (time.perf_counter() - start) / 1e6


async def cluster_round(addrs: list[str], blob_addr: str, seconds: float, round_no: int) -> dict[str, float]:
    from cachefs.backing.client import BackingClient
    from cachefs.backing.cluster import ClusterView, DatanodeInfo
    from cachefs.backing.policy import VolumePolicy
    from cachefs.ids import BlockKey
    from cachefs.rpc import RpcPool

    infos = [DatanodeInfo(f"dn{i}", a, ZONES[i]) for i, a in enumerate(addrs)]
    policies = {"ec": VolumePolicy.parse("ec:4+2"), "rep": VolumePolicy.parse("replica:3")}
    view = ClusterView.build(infos, {name: (p, 64) for name, p in policies.items()})
    degraded = ClusterView(
        [i if i.id not in ("dn1", "dn4") else DatanodeInfo(i.id, i.addr, i.zone, "down") for i in infos],
        view.volumes.values())
    data = os.urandom(BLOCK)
    out: dict[str, float] = {}
    async with RpcPool(secret=SECRET) as pool:

        async def baseline(w: int, n: int) -> int:
            reply = await pool.call(blob_addr, "get", {"size": BLOCK})
            return len(reply.payload)

        # The baseline first, before the puts leave dirty pages to write back.
        out["rpc_get_8"] = await _loop(8, seconds, baseline)
        out["rpc_get_1"] = await _loop(1, seconds, baseline)
        client = BackingClient(pool, view, zone="a")
        base = (round_no + 1) << 32
        for name in policies:
            for inflight in (1, 8):
                async def put(w: int, n: int, name=name, inflight=inflight) -> int:
                    key = BlockKey(base + inflight * 1_000_000 + w * 10_000 + n, 0)
                    await client.put_block(name, key, data)
                    return BLOCK
                out[f"{name}_put_{inflight}"] = await _loop(inflight, seconds, put)
            keys = [BlockKey(base + 7, i) for i in range(BLOCKS_PER_POLICY)]
            for key in keys:
                await client.put_block(name, key, data)
            for inflight in (1, 8):
                async def get(w: int, n: int, keys=keys, name=name) -> int:
                    return len(await client.get_block(name, random.choice(keys)))
                out[f"{name}_get_{inflight}"] = await _loop(inflight, seconds, get)
            if name == "ec":
                slow = BackingClient(pool, degraded)

                async def get_degraded(w: int, n: int, keys=keys, slow=slow) -> int:
                    return len(await slow.get_block("ec", random.choice(keys)))
                out["ec_get_degraded_8"] = await _loop(8, seconds, get_degraded)
        out["rpc_get_8_after"] = await _loop(8, seconds, baseline)
    return out


def run(repeat: int, seconds: float, fsync: bool) -> dict:
    root = Path(tempfile.mkdtemp(prefix="storage-bench-"))
    secret_file = root / "secret"
    secret_file.write_bytes(SECRET)
    ports = [free_port() for _ in ZONES]
    blob_port = free_port()
    procs = [spawn(["-m", "bench.storage_bench", "--serve-blob", str(blob_port)])]
    try:
        # The bench's own entry point runs the same command, under cProfile when asked.
        entry = ["-m", "bench.storage_bench", "--serve-datanode"] if os.environ.get("BENCH_PROFILE") else \
            ["-m", "cachefs.cli", "datanode"]
        for i, port in enumerate(ports):
            procs.append(spawn(
                [*entry, "--zone", ZONES[i], "--data-dir", str(root / f"dn{i}"),
                 "--capacity", "20G", "--listen", f"127.0.0.1:{port}", "--node-id", f"dn{i}",
                 "--secret-file", str(secret_file), "--log-level", "WARNING",
                 *([] if fsync else ["--no-fsync"])]))
        for port, proc in zip([blob_port, *ports], procs, strict=True):
            wait_for_port(port, proc=proc)
        samples: dict[str, list[float]] = {}
        for r in range(repeat):
            enc, dec = codec_rates(seconds)
            samples.setdefault("encode", []).append(enc)
            samples.setdefault("decode", []).append(dec)
            result = trio.run(cluster_round, [f"127.0.0.1:{p}" for p in ports],
                              f"127.0.0.1:{blob_port}", seconds, r)
            for k, v in result.items():
                samples.setdefault(k, []).append(v)
        med = {k: median(v) for k, v in samples.items()}
    finally:
        for p in procs:
            stop(p)
        shutil.rmtree(root, ignore_errors=True)
    out = {"repeat": repeat, "fsync": fsync,
           "ec_encode_mb_per_s": round(med["encode"], 1),
           "ec_decode_2_missing_mb_per_s": round(med["decode"], 1)}
    for key in ("ec_put_1", "ec_put_8", "ec_get_1", "ec_get_8", "rep_put_1", "rep_put_8",
                "rep_get_1", "rep_get_8", "ec_get_degraded_8", "rpc_get_1", "rpc_get_8", "rpc_get_8_after"):
        out[f"{key.replace('rep_', 'replica3_').replace('ec_', 'ec42_')}_mb_per_s"] = round(med[key], 1)
    out["ec_get_ratio_vs_rpc"] = ratio(med["ec_get_8"], med["rpc_get_8"])
    out["ec_degraded_get_ratio_vs_healthy"] = ratio(med["ec_get_degraded_8"], med["ec_get_8"])
    out["replica_get_ratio_vs_rpc"] = ratio(med["rep_get_8"], med["rpc_get_8"])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (median reported)")
    parser.add_argument("--seconds", type=float, default=1.5, help="duration of each run")
    parser.add_argument("--no-fsync", action="store_true", help="datanodes skip fsync (not crash safe)")
    parser.add_argument("--serve-blob", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-datanode", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_blob:
        return serve_blob(args.serve_blob)
    if args.serve_datanode is not None:
        return serve_datanode(args.serve_datanode)
    r = run(args.repeat, args.seconds, not args.no_fsync)

    def show() -> None:
        rpc8 = r["rpc_get_8_mb_per_s"]
        rows = [
            ["ISA-L ec:4+2 encode, 1 core", r["ec_encode_mb_per_s"], ""],
            ["ISA-L ec:4+2 decode, 2 missing, 1 core", r["ec_decode_2_missing_mb_per_s"], ""],
            ["RPC 4 MiB payload get, 1 in flight (baseline)", r["rpc_get_1_mb_per_s"], ""],
            ["RPC 4 MiB payload get, 8 in flight (baseline)", rpc8, 1.0],
            ["  the same, measured again at the end", r["rpc_get_8_after_mb_per_s"],
             ratio(r["rpc_get_8_after_mb_per_s"], rpc8)],
        ]
        for name, label in (("ec42", "ec:4+2"), ("replica3", "replica:3")):
            for op in ("put", "get"):
                for inflight in (1, 8):
                    v = r[f"{name}_{op}_{inflight}_mb_per_s"]
                    rows.append([f"{label} {op}, {inflight} in flight", v, ratio(v, rpc8)])
        rows.append(["ec:4+2 get, 2 nodes down, 8 in flight", r["ec42_get_degraded_8_mb_per_s"],
                     ratio(r["ec42_get_degraded_8_mb_per_s"], rpc8)])
        print_table(f"Backing storage, 4 MiB blocks, 6 datanodes (medians of {r['repeat']}, fsync={r['fsync']})",
                    ["case", "MB/s", "vs RPC get x8"], rows,
                    note="shared 2-core machine: client, 6 datanodes and the baseline server share the cores")

    emit(r, args.json, show)


if __name__ == "__main__":
    main()
