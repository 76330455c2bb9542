"""mdtest-like metadata benchmark through the filesystem: cachefs vs JuiceFS vs passthrough vs local.

    python -m bench.meta_fs_bench [--meta-files 2000] [--meta-dirs 20] [--meta-procs 1,4] [--repeat 1]
                                  [--meta-mixed-clients 4] [--meta-mixed-seconds 20] [--quick] [--json]

Phases, each timed over all processes (files/s):

- ``create``: create and write a small file (110 KiB by default), close it;
- ``stat``: ``os.stat`` every file (kernel caches as they are after create);
- ``read_cold``: page cache dropped, read every file whole;
- ``read2``: read every file again, page cache kept (what the kernel serves);
- ``read_warm``: page cache (and the kernel's dentries and inodes) dropped
  again, every file read: the warm epoch, served by the filesystem's own
  caches. On cachefs the metanodes' client RPCs (their ``cachefs_rpc_calls_total``)
  are counted over it: ``meta_rpcs_per_file_warm_epoch``;
- ``unlink``: remove every file.

On cachefs the client RPCs per file are counted over ``create`` and ``unlink``
too (``meta_rpcs_per_file_create``, ``meta_rpcs_per_file_unlink``).

Then ``mixed``, a dbench-style run: N clients, each in its own directory for a
bounded time, create files in a few writes, fsync every fourth, stat, read
back, rename, list the directory and unlink the oldest (MB/s moved and ops/s).
On cachefs the metanodes' client RPCs are counted over it too, per file made
(``meta_rpcs_per_file_mixed``, and by method in ``mixed_rpcs_by_method``),
and each target's mixed run notes the 1-minute load average at its start
(``mixed_load``: the machine is shared, the figures move with it).
``--meta-files 0`` runs the mixed part alone.

Then ``dbench``: the real dbench (Debian's ``dbench`` package, its NetBench
load file ``client.txt``) with the mixed run's client count for
``--meta-dbench-seconds`` on each target, the run issue 16 reported (MB/s as
dbench prints it; ``meta_dbench_vs_juicefs``). dbench checks each call's
result against the load file and exits non-zero on a mismatch, which fails
the run. Without dbench installed it is left out with a note.

The files are spread over ``--meta-dirs`` directories; with P processes each
takes every P-th directory. Targets: local disk, the pyfuse3 passthrough
(``bench.passthroughfs`` over local disk: the ceiling for a Python FUSE
daemon), JuiceFS (SQLite metadata, disk cache on, S3 behind the emulated
link) with its defaults and tuned for read-mostly data (``JUICEFS_TUNED``;
ratios take the better of the two), and cachefs (3 Raft metanodes with
fsync, datanodes behind the same link). The link is the anchor's 2 ms RTT
profile of ``bench.wan``.

Each JuiceFS mount keeps the blocks it writes in its disk cache, so the
cachefs mount gets an L2 of the same size, as every lab mount has one:
without it, a cold read found the files just written in L1 only while they
fit there, and with ``--repeat 3`` (6,000 files through a 512 MiB L1) it
fell to the cache-tier miss path, 183-263 files/s against JuiceFS reading
its disk cache at 845-1,979.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import median, print_table, ratio
from bench.fio_compare import parse_size, passthrough
from bench.wan import RTT2, Testbed, drop_page_cache, run_on_testbed

PHASES = ("create", "stat", "read_cold", "read2", "read_warm", "unlink")
TARGETS = ("local", "passthrough", "juicefs", "juicefs_tuned", "cachefs")
JUICEFS = ("juicefs", "juicefs_tuned")  # ratios against JuiceFS take the better of these
MIXED_SIZES = (4 << 10, 16 << 10, 64 << 10)  # the sizes of the mixed run's writes
MIXED_WINDOW = 8  # files a mixed client keeps before it unlinks the oldest
DBENCH_LOADFILE = Path("/usr/share/dbench/client.txt")  # Debian's dbench package
# Metanode methods no client sends: Raft among the replicas, and the storage nodes' registration and
# heartbeats (cluster_map stays in: clients and storage nodes both ask it, and the metrics do not say who).
PEER = ("raft_", "node_heartbeat", "register_node")
COUNTED = {"create": "rpcs_per_file_create", "read_warm": "rpcs_per_file_warm", "unlink": "rpcs_per_file_unlink"}


def _phase(phase: str, root: str, dirs: list[int], per_dir: int, size: int) -> int:
    """One process's share of one phase; returns the files it handled."""
    payload = os.urandom(size) if phase == "create" else b""
    done = 0
    for d in dirs:
        base = os.path.join(root, f"d{d:04d}")
        for i in range(per_dir):
            path = os.path.join(base, f"f{i:06d}")
            if phase == "create":
                with open(path, "wb") as f:
                    f.write(payload)
            elif phase == "stat":
                os.stat(path)
            elif phase.startswith("read"):
                with open(path, "rb") as f:
                    while f.read(1 << 20):
                        pass
            else:
                os.unlink(path)
            done += 1
    return done


def run_target(root: Path, procs: int, files: int, ndirs: int, size: int,
               count_rpcs: Callable[[], dict[str, float]] | None = None,
               rpcs: dict[str, float] | None = None) -> dict[str, float]:
    """files/s of every phase on one directory tree with ``procs`` processes. With
    ``count_rpcs`` (calls so far by method) also the client calls per file of the
    phases in ``COUNTED`` (``rpcs_per_file_warm``: the warm read); ``rpcs`` gets the
    warm read's by method."""
    per_dir = max(1, files // ndirs)
    for d in range(ndirs):
        (root / f"d{d:04d}").mkdir(parents=True, exist_ok=True)
    shares = [list(range(p, ndirs, procs)) for p in range(procs)]
    out = {}
    with ProcessPoolExecutor(procs) as pool:
        list(pool.map(int, range(procs)))  # the workers exist before the clock starts
        for phase in PHASES:
            if phase in ("read_cold", "read_warm"):
                drop_page_cache()
            counted = count_rpcs is not None and phase in COUNTED
            before = count_rpcs() if count_rpcs is not None and counted else {}
            started = time.perf_counter()
            done = sum(pool.map(_phase, [phase] * procs, [str(root)] * procs, shares,
                                [per_dir] * procs, [size] * procs))
            out[phase] = done / (time.perf_counter() - started)
            if count_rpcs is not None and counted:
                grown = {m: v - before.get(m, 0.0) for m, v in count_rpcs().items() if not m.startswith(PEER)}
                grown = {m: v for m, v in grown.items() if v}
                out[COUNTED[phase]] = sum(grown.values()) / done
                if rpcs is not None and phase == "read_warm":
                    rpcs.update(grown)
    shutil.rmtree(root, ignore_errors=True)
    return out


def _mixed_client(root: str, client: int, seconds: float) -> tuple[int, int, int]:
    """One dbench-style client for ``seconds``: (operations, bytes written and read, files made)."""
    rng = random.Random(client)
    base = os.path.join(root, f"client{client:02d}")
    os.makedirs(base, exist_ok=True)
    chunks = {n: os.urandom(n) for n in MIXED_SIZES}
    kept: list[str] = []
    ops = moved = i = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        path = os.path.join(base, f"new{i:06d}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(rng.randint(1, 4)):
            moved += os.write(fd, chunks[rng.choice(MIXED_SIZES)])
            ops += 1
        if i % 4 == 0:
            os.fsync(fd)
            ops += 1
        os.close(fd)
        os.stat(path)
        with open(path, "rb") as f:
            moved += len(f.read())
        final = os.path.join(base, f"file{i:06d}")
        os.rename(path, final)
        os.stat(final)
        ops += 5  # create, stat, read, rename, stat
        kept.append(final)
        if len(kept) > MIXED_WINDOW:
            os.unlink(kept.pop(0))
            ops += 1
        if i % 16 == 0:
            os.listdir(base)
            ops += 1
        i += 1
    for path in kept:
        os.unlink(path)
    return ops, moved, i


def run_mixed(root: Path, clients: int, seconds: float,
              count_rpcs: Callable[[], dict[str, float]] | None = None,
              rpcs: dict[str, float] | None = None) -> dict[str, float]:
    """The mixed run with ``clients`` processes: MB/s (10^6 bytes written and read) and ops/s,
    the 1-minute load average at its start; with ``count_rpcs`` (calls so far by method) also
    the client calls per file made (``rpcs_per_file_mixed``), and into ``rpcs`` by method."""
    root.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(clients) as pool:
        list(pool.map(int, range(clients)))
        load = os.getloadavg()[0]
        before = count_rpcs() if count_rpcs is not None else {}
        started = time.perf_counter()
        results = list(pool.map(_mixed_client, [str(root)] * clients, range(clients), [seconds] * clients))
        elapsed = time.perf_counter() - started
        after = count_rpcs() if count_rpcs is not None else {}
    shutil.rmtree(root, ignore_errors=True)
    files = sum(f for _, _, f in results)
    out = {"mixed_mb_s": sum(b for _, b, _ in results) / elapsed / 1e6,
           "mixed_ops_s": sum(o for o, _, _ in results) / elapsed,
           "mixed_load": load}
    if count_rpcs is not None and files:
        grown = {m: v - before.get(m, 0.0) for m, v in after.items() if not m.startswith(PEER)}
        grown = {m: v for m, v in grown.items() if v}
        out["rpcs_per_file_mixed"] = sum(grown.values()) / files
        if rpcs is not None:
            rpcs.clear()
            rpcs.update({m: round(v / files, 3) for m, v in grown.items()})
    return out


def run_dbench(root: Path, clients: int, seconds: float) -> dict[str, float]:
    """dbench with ``clients`` clients for ``seconds`` in ``root``: its MB/s
    (``dbench_mb_s``) and the 1-minute load average at its start.

    Raises:
        RuntimeError: dbench failed (a call's result differed from the load
            file's, or it ran past its deadline), with its output's tail.
    """
    root.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    # dbench reports 0 MB/s for a 1 s run
    argv = ["dbench", "-c", str(DBENCH_LOADFILE), "-D", str(root), "-t", str(max(2, round(seconds))), str(clients)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"dbench in {root} ran past {seconds + 120:.0f} s") from None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    found = re.search(r"^Throughput ([0-9.]+) MB/sec", proc.stdout, re.M)
    if proc.returncode != 0 or found is None:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"dbench in {root} failed (exit {proc.returncode}):\n{tail}")
    return {"dbench_mb_s": float(found.group(1)), "dbench_load": load}


def dbench_available() -> bool:
    return shutil.which("dbench") is not None and DBENCH_LOADFILE.is_file()


def _progress(msg: str) -> None:
    print(f"[meta {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def targets(bed: Testbed, work: Path, names: list[str]) -> Iterator[dict[str, Path]]:
    """Mount every target for the run: name -> a directory to work in."""
    with contextlib.ExitStack() as stack:
        out: dict[str, Path] = {}
        local = work / "meta-local"
        local.mkdir(parents=True, exist_ok=True)
        if "local" in names:
            out["local"] = local
        if "passthrough" in names:
            out["passthrough"] = stack.enter_context(passthrough(local, work / "meta-pt", keep_cache=False))
        if "juicefs" in names and bed.juicefs is not None:
            out["juicefs"] = bed.juicefs.mountpoint
        if "juicefs_tuned" in names:
            tuned = bed.start_juicefs_tuned()
            if tuned is not None:
                out["juicefs_tuned"] = tuned.mountpoint
        if "cachefs" in names:
            mnt = bed.mount_cachefs(work / "meta-cfs", l2=work / "meta-cfs-l2")  # as JuiceFS's disk cache
            stack.callback(bed.umount_cachefs, mnt)
            out["cachefs"] = mnt
        yield out


def measure(bed: Testbed, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    size = parse_size(args.meta_size)
    bed.set_link(RTT2)
    runs: dict[str, dict[str, dict[str, list[float]]]] = {}
    warm_rpcs: dict[str, float] = {}  # the last 1-process warm epoch on cachefs, by method
    mixed_rpcs: dict[str, float] = {}  # the last mixed run on cachefs: calls per file made, by method

    def record(name: str, procs: int, rates: dict[str, float]) -> None:
        for phase, value in rates.items():
            runs.setdefault(name, {}).setdefault(f"p{procs}", {}).setdefault(phase, []).append(value)

    with targets(bed, work, args.meta_targets) as dirs:
        for procs in args.meta_procs if args.meta_files > 0 else ():
            for rep in range(args.repeat):
                for name, base in dirs.items():
                    _progress(f"{name}: {args.meta_files} files of {size} B in {args.meta_dirs} dirs, {procs} processes")
                    counter = bed.metanode_rpc_calls if name == "cachefs" else None
                    record(name, procs, run_target(base / f"mdtest-p{procs}-r{rep}-{os.getpid()}", procs,
                                                   args.meta_files, args.meta_dirs, size, counter,
                                                   warm_rpcs if procs == 1 else None))
        if args.meta_mixed_seconds > 0:
            for rep in range(args.repeat):
                for name, base in dirs.items():
                    _progress(f"{name}: mixed, {args.meta_mixed_clients} clients for {args.meta_mixed_seconds} s")
                    counter = bed.metanode_rpc_calls if name == "cachefs" else None
                    record(name, args.meta_mixed_clients,
                           run_mixed(base / f"mixed-r{rep}-{os.getpid()}", args.meta_mixed_clients,
                                     args.meta_mixed_seconds, counter, mixed_rpcs))
        if args.meta_dbench_seconds > 0 and dbench_available():
            for rep in range(args.repeat):
                for name, base in dirs.items():
                    _progress(f"{name}: dbench, {args.meta_mixed_clients} clients for {args.meta_dbench_seconds} s")
                    record(name, args.meta_mixed_clients,
                           run_dbench(base / f"dbench-r{rep}-{os.getpid()}", args.meta_mixed_clients,
                                      args.meta_dbench_seconds))
        elif args.meta_dbench_seconds > 0:
            _progress(f"dbench left out: no dbench command or no {DBENCH_LOADFILE} (Debian's dbench package)")
    table = {t: {p: {ph: {"median": round(median(v), 3 if ph.startswith("rpcs") or ph.endswith("load") else 1),
                          "min": round(min(v), 3), "max": round(max(v), 3)}
                     for ph, v in phases.items()} for p, phases in by_p.items()} for t, by_p in runs.items()}

    def med(target: str, phase: str, procs: int = 1) -> float:
        return table.get(target, {}).get(f"p{procs}", {}).get(phase, {}).get("median", float("nan"))

    def jfs(phase: str, procs: int = 1) -> float:
        """The better JuiceFS (default or tuned) in this phase."""
        values = [v for v in (med(t, phase, procs) for t in JUICEFS) if v == v]
        return max(values) if values else float("nan")

    result: dict[str, Any] = {
        "files": args.meta_files, "dirs": args.meta_dirs, "file_bytes": size, "procs": args.meta_procs,
        "repeat": args.repeat, "link": RTT2.describe(), "files_per_s": table,
        "mixed_clients": args.meta_mixed_clients, "mixed_seconds": args.meta_mixed_seconds,
    }
    for phase in PHASES:
        result[f"meta_{phase}_vs_juicefs"] = ratio(med("cachefs", phase), jfs(phase))
        result[f"meta_{phase}_vs_passthrough"] = ratio(med("cachefs", phase), med("passthrough", phase))
        result[f"meta_{phase}_vs_local"] = ratio(med("cachefs", phase), med("local", phase))
        if 4 in args.meta_procs:
            result[f"meta_{phase}_p4_vs_juicefs"] = ratio(med("cachefs", phase, 4), jfs(phase, 4))
            result[f"meta_{phase}_p4_vs_local"] = ratio(med("cachefs", phase, 4), med("local", phase, 4))
    result["meta_rpcs_per_file_warm_epoch"] = med("cachefs", "rpcs_per_file_warm", 1)
    result["meta_rpcs_per_file_create"] = med("cachefs", "rpcs_per_file_create", 1)
    result["meta_rpcs_per_file_unlink"] = med("cachefs", "rpcs_per_file_unlink", 1)
    result["warm_epoch_rpcs_by_method"] = warm_rpcs
    if args.meta_mixed_seconds > 0:
        n = args.meta_mixed_clients
        result["meta_mixed_vs_juicefs"] = ratio(med("cachefs", "mixed_mb_s", n), jfs("mixed_mb_s", n))
        result["meta_mixed_ops_vs_juicefs"] = ratio(med("cachefs", "mixed_ops_s", n), jfs("mixed_ops_s", n))
        result["meta_mixed_vs_local"] = ratio(med("cachefs", "mixed_mb_s", n), med("local", "mixed_mb_s", n))
        result["meta_rpcs_per_file_mixed"] = med("cachefs", "rpcs_per_file_mixed", n)
        result["mixed_rpcs_by_method"] = mixed_rpcs
    n = args.meta_mixed_clients
    if not math.isnan(med("cachefs", "dbench_mb_s", n)):  # dbench ran
        result["dbench_seconds"] = args.meta_dbench_seconds
        result["meta_dbench_vs_juicefs"] = ratio(med("cachefs", "dbench_mb_s", n), jfs("dbench_mb_s", n))
        result["meta_dbench_vs_local"] = ratio(med("cachefs", "dbench_mb_s", n), med("local", "dbench_mb_s", n))
    return result


def show(result: dict[str, Any]) -> None:
    for procs in result["procs"] if result["files"] > 0 else ():
        rows = []
        for target, by_p in result["files_per_s"].items():
            cells = by_p.get(f"p{procs}", {})
            rows.append([target, *[cells.get(ph, {}).get("median", float("nan")) for ph in PHASES]])
        print_table(f"metadata, files/s, {procs} process(es) (median)", ["target", *PHASES], rows)
    if result.get("mixed_seconds"):
        n = result["mixed_clients"]
        rows = [[t, *(by_p.get(f"p{n}", {}).get(k, {}).get("median", float("nan"))
                      for k in ("mixed_mb_s", "mixed_ops_s", "mixed_load"))]
                for t, by_p in result["files_per_s"].items()]
        print_table(f"mixed (dbench-style), {n} clients, {result['mixed_seconds']} s (median)",
                    ["target", "MB/s", "ops/s", "load (1 min)"], rows,
                    note=f"cachefs metanode RPCs per file made: {result.get('mixed_rpcs_by_method')}")
    if result.get("dbench_seconds"):
        n = result["mixed_clients"]
        rows = [[t, *(by_p.get(f"p{n}", {}).get(k, {}).get("median", float("nan"))
                      for k in ("dbench_mb_s", "dbench_load"))]
                for t, by_p in result["files_per_s"].items()]
        print_table(f"dbench (client.txt), {n} clients, {result['dbench_seconds']} s (median)",
                    ["target", "MB/s", "load (1 min)"], rows)
    ratios = [[k, v] for k, v in sorted(result.items()) if k.startswith("meta_")]
    print_table("cachefs ratios (files/s; JuiceFS: the better of default and tuned)", ["ratio", "value"], ratios,
                note="aims (issue 13): stat >= 1.0 passthrough, cold read >= 1.5 JuiceFS, read2 >= 0.8 local, "
                     "create >= 2 JuiceFS, unlink >= 1.5 JuiceFS, <= 0.05 RPCs/file warm, mixed and dbench >= 1.5 JuiceFS; "
                     "shared machine: noisy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--meta-files", dest="meta_files", type=int, default=1000,
                        help="files per run (0: only the mixed run)")
    parser.add_argument("--meta-dirs", dest="meta_dirs", type=int, default=10, help="directories per run")
    parser.add_argument("--meta-size", dest="meta_size", default="110K", help="bytes per file")
    parser.add_argument("--meta-procs", dest="meta_procs", default="1,4", help="process counts, comma separated")
    parser.add_argument("--meta-targets", dest="meta_targets", default=",".join(TARGETS))
    parser.add_argument("--meta-mixed-clients", dest="meta_mixed_clients", type=int, default=4,
                        help="clients (processes) of the mixed run")
    parser.add_argument("--meta-mixed-seconds", dest="meta_mixed_seconds", type=float, default=20.0,
                        help="seconds of the mixed run per target (0: no mixed run)")
    parser.add_argument("--meta-dbench-seconds", dest="meta_dbench_seconds", type=float, default=20.0,
                        help="seconds of the dbench run per target, with the mixed run's clients (0: none)")


def finish_args(args: argparse.Namespace) -> None:
    args.meta_procs = [int(p) for p in str(args.meta_procs).split(",")]
    args.meta_targets = [t for t in str(args.meta_targets).split(",") if t]
    if args.quick:
        args.meta_files, args.meta_dirs = min(args.meta_files, 40), min(args.meta_dirs, 4)
        args.meta_mixed_seconds = min(args.meta_mixed_seconds, 1.0)
        args.meta_dbench_seconds = min(args.meta_dbench_seconds, 2.0)  # dbench's shortest useful run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="40 files in 4 directories, 1 s mixed (smoke test)")
    parser.add_argument("--base-port", type=int, default=27000)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    finish_args(args)
    if os.geteuid() != 0:
        parser.error("needs root (FUSE mounts and drop_caches)")
    run_on_testbed(args, "meta-fs-bench-", measure, show)


if __name__ == "__main__":
    main()
