"""mdtest-like metadata benchmark through the filesystem: cachefs vs JuiceFS vs passthrough vs local.

    python -m bench.meta_fs_bench [--files 2000] [--dirs 20] [--procs 1,4] [--repeat 1] [--quick] [--json]

Phases, each timed over all processes (files/s):

- ``create``: create and write a small file (110 KiB by default), close it;
- ``stat``: ``os.stat`` every file (kernel caches as they are after create);
- ``read_cold``: page cache dropped, read every file whole;
- ``unlink``: remove every file.

The files are spread over ``--dirs`` directories; with P processes each takes
every P-th directory. Targets: local disk, the pyfuse3 passthrough
(``bench.passthroughfs`` over local disk: the ceiling for a Python FUSE
daemon), JuiceFS (SQLite metadata, disk cache on, S3 behind the emulated link)
and cachefs (3 Raft metanodes with fsync, datanodes behind the same link).
The link is the anchor's 2 ms RTT profile of ``bench.wan``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import emit, median, print_table, ratio
from bench.fio_compare import parse_size, passthrough
from bench.wan import RTT2, Testbed, drop_page_cache, juicefs_binary

PHASES = ("create", "stat", "read_cold", "unlink")
TARGETS = ("local", "passthrough", "juicefs", "cachefs")


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
            elif phase == "read_cold":
                with open(path, "rb") as f:
                    while f.read(1 << 20):
                        pass
            else:
                os.unlink(path)
            done += 1
    return done


def run_target(root: Path, procs: int, files: int, ndirs: int, size: int) -> dict[str, float]:
    """files/s of every phase on one directory tree with ``procs`` processes."""
    per_dir = max(1, files // ndirs)
    for d in range(ndirs):
        (root / f"d{d:04d}").mkdir(parents=True, exist_ok=True)
    shares = [list(range(p, ndirs, procs)) for p in range(procs)]
    out = {}
    with ProcessPoolExecutor(procs) as pool:
        list(pool.map(int, range(procs)))  # the workers exist before the clock starts
        for phase in PHASES:
            if phase == "read_cold":
                drop_page_cache()
            started = time.perf_counter()
            done = sum(pool.map(_phase, [phase] * procs, [str(root)] * procs, shares,
                                [per_dir] * procs, [size] * procs))
            out[phase] = done / (time.perf_counter() - started)
    shutil.rmtree(root, ignore_errors=True)
    return out


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
        if "cachefs" in names:
            mnt = bed.mount_cachefs(work / "meta-cfs")
            stack.callback(bed.umount_cachefs, mnt)
            out["cachefs"] = mnt
        yield out


def measure(bed: Testbed, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    size = parse_size(args.meta_size)
    bed.set_link(RTT2)
    runs: dict[str, dict[str, dict[str, list[float]]]] = {}
    with targets(bed, work, args.meta_targets) as dirs:
        for procs in args.meta_procs:
            for rep in range(args.repeat):
                for name, base in dirs.items():
                    _progress(f"{name}: {args.meta_files} files of {size} B in {args.meta_dirs} dirs, {procs} processes")
                    rates = run_target(base / f"mdtest-p{procs}-r{rep}-{os.getpid()}", procs, args.meta_files,
                                       args.meta_dirs, size)
                    for phase, value in rates.items():
                        runs.setdefault(name, {}).setdefault(f"p{procs}", {}).setdefault(phase, []).append(value)
    table = {t: {p: {ph: {"median": round(median(v), 1), "min": round(min(v), 1), "max": round(max(v), 1)}
                     for ph, v in phases.items()} for p, phases in by_p.items()} for t, by_p in runs.items()}

    def med(target: str, phase: str, procs: int = 1) -> float:
        return table.get(target, {}).get(f"p{procs}", {}).get(phase, {}).get("median", float("nan"))

    result: dict[str, Any] = {
        "files": args.meta_files, "dirs": args.meta_dirs, "file_bytes": size, "procs": args.meta_procs,
        "repeat": args.repeat, "link": RTT2.describe(), "files_per_s": table,
    }
    for phase in PHASES:
        result[f"meta_{phase}_vs_juicefs"] = ratio(med("cachefs", phase), med("juicefs", phase))
        result[f"meta_{phase}_vs_passthrough"] = ratio(med("cachefs", phase), med("passthrough", phase))
        if 4 in args.meta_procs:
            result[f"meta_{phase}_vs_juicefs_p4"] = ratio(med("cachefs", phase, 4), med("juicefs", phase, 4))
    return result


def show(result: dict[str, Any]) -> None:
    for procs in result["procs"]:
        rows = []
        for target, by_p in result["files_per_s"].items():
            cells = by_p.get(f"p{procs}", {})
            rows.append([target, *[cells.get(ph, {}).get("median", float("nan")) for ph in PHASES]])
        print_table(f"metadata, files/s, {procs} process(es) (median)", ["target", *PHASES], rows)
    ratios = [[k, v] for k, v in sorted(result.items()) if k.startswith("meta_")]
    print_table("cachefs ratios (files/s)", ["ratio", "value"], ratios,
                note="aim: ahead of JuiceFS in every phase, >= 0.5 of the passthrough; shared machine: noisy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--meta-files", dest="meta_files", type=int, default=1000, help="files per run")
    parser.add_argument("--meta-dirs", dest="meta_dirs", type=int, default=10, help="directories per run")
    parser.add_argument("--meta-size", dest="meta_size", default="110K", help="bytes per file")
    parser.add_argument("--meta-procs", dest="meta_procs", default="1,4", help="process counts, comma separated")
    parser.add_argument("--meta-targets", dest="meta_targets", default=",".join(TARGETS))


def finish_args(args: argparse.Namespace) -> None:
    args.meta_procs = [int(p) for p in str(args.meta_procs).split(",")]
    args.meta_targets = [t for t in str(args.meta_targets).split(",") if t]
    if args.quick:
        args.meta_files, args.meta_dirs = min(args.meta_files, 40), min(args.meta_dirs, 4)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="40 files in 4 directories (smoke test)")
    parser.add_argument("--base-port", type=int, default=27000)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    finish_args(args)
    if os.geteuid() != 0:
        parser.error("needs root (FUSE mounts and drop_caches)")
    work = Path(tempfile.mkdtemp(prefix="meta-fs-bench-", dir=args.workdir))
    bed = Testbed(work / "bed", args.base_port, with_juicefs=juicefs_binary() is not None)
    try:
        bed.up()
        result = measure(bed, args, work)
    finally:
        bed.down()
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.json, lambda: show(result))


if __name__ == "__main__":
    main()
