"""Getting a dataset in: ``cachefs import --jobs N`` and ``cp -a`` of a generated tree, on every target.

    python -m bench.ingest_bench [--ingest-files 10000] [--ingest-size 110K] [--ingest-dirs 100]
                                 [--ingest-jobs 8] [--repeat 1] [--quick] [--json]

The tree (ImageNet-like: ``--ingest-files`` files of ``--ingest-size`` bytes
in ``--ingest-dirs`` class folders) is made once on local disk and stays in
the page cache, so every copy reads it at memory speed. Each copy goes to a
new directory and is timed as a whole command (the user's wait, process start
included); files/s is files over that time. Targets: local disk, JuiceFS
(SQLite, S3 behind the emulated link) and cachefs through its mount; cachefs
also through the native client (``cachefs import --volume``, no FUSE).

``--json`` headline: ``ingest_files_per_s`` (cachefs import, the faster of
the mount and the native client; ``ingest_mode`` says which), and ratios to
``cp -a`` on the same target and to JuiceFS. The aim (issue 13) is at least
1,000 files/s for 110 KiB files with 8 jobs. ``profile`` says where the time
of each cachefs copy goes: CPU milliseconds per file of the metanodes,
datanodes, cache nodes, the mount and the copying command (on two cores,
1,000 files/s needs under 2 ms in all), and the metanodes' RPCs per file by
method (``raft_step``: replication among them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, median, print_table, ratio
from bench.fio_compare import parse_size
from bench.wan import RTT2, Testbed, run_on_testbed

METHODS = ("import", "cp")


def make_tree(root: Path, files: int, dirs: int, size: int) -> None:
    """``files`` files of ``size`` random bytes in ``dirs`` folders (distinct contents: no dedup helps)."""
    for d in range(dirs):
        (root / f"n{d:08d}").mkdir(parents=True, exist_ok=True)
    block = os.urandom(size + files)
    for i in range(files):
        (root / f"n{i % dirs:08d}" / f"img_{i:07d}.JPEG").write_bytes(block[i:i + size])


def _progress(msg: str) -> None:
    print(f"[ingest {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def copy_once(method: str, src: Path, dst: str, jobs: int, native: list[str] | None = None) -> tuple[float, float]:
    """Seconds of one whole copy of ``src`` to ``dst`` (which cp makes; import copies into it),
    and the CPU seconds of the copying command."""
    if method == "cp":
        argv = ["cp", "-a", str(src), dst]
    else:
        argv = [sys.executable, "-m", "cachefs.cli", "import", str(src), dst, "--jobs", str(jobs), "--quiet",
                "--json", *(native or [])]
    cpu = os.times()
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=7200)
    seconds = time.perf_counter() - started
    after = os.times()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
    return seconds, after.children_user + after.children_system - cpu.children_user - cpu.children_system


def measure(bed: Testbed, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    size = parse_size(args.ingest_size)
    bed.set_link(RTT2)
    src = work / "ingest-src"
    _progress(f"generating {args.ingest_files} files of {size} B in {args.ingest_dirs} folders")
    make_tree(src, args.ingest_files, args.ingest_dirs, size)
    runs: dict[str, list[float]] = {}
    profile: dict[str, dict[str, dict[str, float]]] = {}  # the last repeat's
    mnt = bed.mount_cachefs(work / "ingest-cfs")
    native = ["--volume", "lab", "--meta", ",".join(bed.lab.meta_addrs), "--zone", "z1",
              "--secret-file", str(bed.lab.credential_file("client"))]
    local = work / "ingest-local"
    local.mkdir()
    places: dict[str, Path] = {"local": local, "cachefs": mnt}
    if bed.juicefs is not None:
        places["juicefs"] = bed.juicefs.mountpoint
    try:
        for rep in range(args.repeat):
            cases: list[tuple[str, str, Path, list[str] | None]] = [
                (target, method, base, None) for target, base in places.items() for method in METHODS]
            cases.append(("cachefs_native", "import", mnt, native))
            for target, method, base, nat in cases:
                name = f"ingest-{method}-{target}-r{rep}-{os.getpid()}"
                dst = f"/{name}" if nat is not None else str(base / name)
                if method == "import":
                    (base / name).mkdir()
                _progress(f"{target}: {method} of {args.ingest_files} files ({args.ingest_jobs} jobs)")
                cpu0, rpc0 = (bed.cpu_seconds([mnt]), bed.metanode_rpc_calls()) if target.startswith("cachefs") \
                    else ({}, {})
                seconds, own_cpu = copy_once(method, src, dst, args.ingest_jobs, nat)
                runs.setdefault(f"{target}_{method}", []).append(args.ingest_files / seconds)
                if target.startswith("cachefs"):  # where the time goes: CPU and metanode RPCs per file
                    cpu = {k: v - cpu0.get(k, 0.0) for k, v in bed.cpu_seconds([mnt]).items()}
                    cpu[method] = own_cpu
                    profile[f"{target}_{method}"] = {
                        "cpu_ms_per_file": {k: round(1000 * v / args.ingest_files, 2) for k, v in cpu.items()},
                        "metanode_rpcs_per_file": {m: round((v - rpc0.get(m, 0.0)) / args.ingest_files, 2)
                                                   for m, v in bed.metanode_rpc_calls().items()
                                                   if v > rpc0.get(m, 0.0)}}
                shutil.rmtree(base / name, ignore_errors=True)  # untimed
    finally:
        bed.umount_cachefs(mnt)
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    table = {k: {"median": round(median(v), 1), "min": round(min(v), 1), "max": round(max(v), 1)}
             for k, v in runs.items()}

    def med(key: str) -> float:
        return table.get(key, {}).get("median", float("nan"))

    mode = "native" if med("cachefs_native_import") > med("cachefs_import") else "mount"
    best = med("cachefs_native_import" if mode == "native" else "cachefs_import")
    return {
        "files": args.ingest_files, "file_bytes": size, "dirs": args.ingest_dirs, "jobs": args.ingest_jobs,
        "repeat": args.repeat, "link": RTT2.describe(), "files_per_s": table, "profile": profile,
        "ingest_files_per_s": best, "ingest_mode": mode,
        "ingest_mount_files_per_s": med("cachefs_import"), "ingest_native_files_per_s": med("cachefs_native_import"),
        "ingest_vs_cp": ratio(best, med("cachefs_cp")),
        "ingest_vs_juicefs_cp": ratio(best, med("juicefs_cp")),
        "ingest_vs_juicefs_import": ratio(best, med("juicefs_import")),
        "ingest_vs_local_cp": ratio(best, med("local_cp")),
    }


def show(result: dict[str, Any]) -> None:
    t = result["files_per_s"]
    rows = [[target, *[t.get(f"{target}_{m}", {}).get("median", float("nan")) for m in METHODS]]
            for target in ("local", "juicefs", "cachefs", "cachefs_native")]
    print_table(f"ingest, {result['files']} files of {result['file_bytes'] >> 10} KiB, files/s (median)",
                ["target", f"cachefs import --jobs {result['jobs']}", "cp -a"], rows)
    print_table("cachefs import ratios", ["ratio", "value"],
                [[k, v] for k, v in sorted(result.items()) if k.startswith("ingest_")],
                note="aim (issue 13): ingest_files_per_s >= 1,000 for 110 KiB files; shared machine: noisy")
    for case, prof in result["profile"].items():
        cpu = prof["cpu_ms_per_file"]
        print_table(f"{case}: CPU ms per file (total {sum(cpu.values()):.1f}) and metanode RPCs per file",
                    ["what", "per file"], [[f"cpu {k}", v] for k, v in sorted(cpu.items())]
                    + [[f"rpc {k}", v] for k, v in sorted(prof["metanode_rpcs_per_file"].items())])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ingest-files", dest="ingest_files", type=int, default=10000, help="files in the tree")
    parser.add_argument("--ingest-dirs", dest="ingest_dirs", type=int, default=100, help="folders in the tree")
    parser.add_argument("--ingest-size", dest="ingest_size", default="110K", help="bytes per file")
    parser.add_argument("--ingest-jobs", dest="ingest_jobs", type=int, default=8, help="cachefs import --jobs")


def finish_args(args: argparse.Namespace) -> None:
    if args.quick:
        args.ingest_files, args.ingest_dirs = min(args.ingest_files, 30), min(args.ingest_dirs, 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="30 files in 3 folders (smoke test)")
    parser.add_argument("--base-port", type=int, default=27000)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    finish_args(args)
    if os.geteuid() != 0:
        parser.error("needs root (FUSE mounts)")
    run_on_testbed(args, "ingest-bench-", measure, show)


if __name__ == "__main__":
    main()
