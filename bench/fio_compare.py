"""fio against cachefs, a minimal pyfuse3 passthrough filesystem, and local disk.

    python -m bench.fio_compare --mount /mnt/cachefs            # an existing mount
    python -m bench.fio_compare --meta 127.0.0.1:7100 --volume vol --insecure
    python -m bench.fio_compare ... --size 256M --repeat 3 --json
    python -m bench.fio_compare --lab --only tutorial        # some cases only

Cases (each repeated, medians reported):

- local disk: sequential re-read of a file in the page cache;
- passthrough (``bench.passthroughfs`` over the same local directory) without
  ``keep_cache``: warm sequential read (the source is in the page cache, the
  FUSE daemon serves every byte: the ceiling for a Python FUSE daemon here),
  and the tutorial random read/write job;
- passthrough with ``keep_cache``: sequential re-read (kernel page cache);
- cachefs: *cold* (a freshly written file whose blocks are only on backing
  storage; page cache dropped, and the mount made anew so that its L1, which
  keeps blocks it wrote, is empty too: not possible with ``--mount``), *warm* (blocks in the cache tier and L1, page
  cache dropped with ``echo 3 > /proc/sys/vm/drop_caches``, so cachefs serves
  every byte), *re-read* (page cache allowed), random 4 KiB / 128 KiB reads,
  sequential write, and the tutorial job.

The ratios in ``--json`` compare cachefs with the references measured in the
same run. Needs root (drop_caches, FUSE mounts) and fio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import REPO, emit, median, print_table, ratio

FIO_DIR = Path(__file__).resolve().parent / "fio"
MiB = 1 << 20
CASES = ("seq", "rand", "tutorial")  # --only: groups of cases (with their references)


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def fio(job: str, directory: Path, size: int, runtime: int = 10) -> dict[str, float]:
    """Run one job file; returns read/write MiB/s summed over its jobs."""
    env = {**os.environ, "DIR": str(directory), "SIZE": str(size), "RUNTIME": str(runtime)}
    proc = subprocess.run(
        ["fio", "--output-format=json", str(FIO_DIR / job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"fio {job} in {directory} failed: {proc.stderr.strip() or proc.stdout[-2000:]}"
        )
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    read = sum(j["read"]["bw_bytes"] for j in out["jobs"]) / MiB
    write = sum(j["write"]["bw_bytes"] for j in out["jobs"]) / MiB
    return {"read": read, "write": write, "total": read + write}


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    return any(
        line.split()[4] == real for line in Path("/proc/self/mountinfo").read_text().splitlines()
    )


def _wait_mounted(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not _mounted(path):
        if proc.poll() is not None:
            raise RuntimeError(f"the filesystem at {path} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing mounted at {path} within {timeout}s")
        time.sleep(0.05)


@contextlib.contextmanager
def passthrough(source: Path, mountpoint: Path, keep_cache: bool) -> Iterator[Path]:
    mountpoint.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "bench.passthroughfs", str(source), str(mountpoint)]
    proc = subprocess.Popen([*args, "--keep-cache"] if keep_cache else args, cwd=REPO)
    try:
        _wait_mounted(mountpoint, proc)
        yield mountpoint
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=False, capture_output=True)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Remount:
    """Unmount and mount again (an empty L1), where this run made the mount."""

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None

    def __call__(self) -> bool:
        if self.fn is None:
            return False
        self.fn()
        return True


@contextlib.contextmanager
def cachefs_mount(
    args: argparse.Namespace, mountpoint: Path, remount: Remount | None = None
) -> Iterator[Path]:
    if args.mount:  # someone else's mount; they may say how to remount it
        if remount is not None:
            remount.fn = getattr(args, "remount", None)
        yield Path(args.mount)
        return
    if args.lab:
        yield from _lab_mount(args, mountpoint, remount)
        return
    mountpoint.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "cachefs.cli",
        "mount",
        "-d",
        args.meta,
        args.volume,
        str(mountpoint),
    ]
    cmd += ["--insecure"] if args.insecure else ["--secret-file", args.secret_file]
    cmd += [
        "--l1-size",
        args.l1_size,
        "--no-write-through",
        "--log-file",
        str(mountpoint.parent / "mount.log"),
    ]
    subprocess.run(cmd, check=True, cwd=REPO, timeout=120)

    def umount() -> None:
        subprocess.run(
            [sys.executable, "-m", "cachefs.cli", "umount", str(mountpoint)],
            cwd=REPO,
            check=False,
            timeout=180,
        )

    def again() -> None:
        umount()
        subprocess.run(cmd, check=True, cwd=REPO, timeout=120)

    if remount is not None:
        remount.fn = again
    try:
        yield mountpoint
    finally:
        umount()


def _lab_mount(
    args: argparse.Namespace, mountpoint: Path, remount: Remount | None = None
) -> Iterator[Path]:
    """A whole lab cluster (cachefs.lab.cluster: 3 metanodes, 6 datanodes, 6 cache nodes, ec:4+2) for this run."""
    import warnings

    from cachefs.lab.cluster import Lab, LabConfig

    lab = Lab(LabConfig(root=str(mountpoint.parent / "lab"), base_port=args.lab_port, metrics=False))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=180)
        opts = ("--l1-size", args.l1_size, "--no-write-through")
        lab.mount(str(mountpoint), *opts)

        def again() -> None:
            lab.umount()
            lab.mount(str(mountpoint), *opts)

        if remount is not None:
            remount.fn = again
        yield mountpoint
    finally:
        lab.down()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    size, repeat = parse_size(args.size), args.repeat
    tut_size = parse_size(args.tutorial_size)
    only = set(getattr(args, "only", None) or CASES)
    cold_remounted = False  # the cold case had an empty L1 (see the module docstring)
    runs: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    work = Path(tempfile.mkdtemp(prefix="fio-compare-", dir=args.workdir))
    try:
        local = work / "local"
        local.mkdir()
        if "seq" in only:
            fio("seq-write-1m.fio", local, size)
            for _ in range(repeat):
                fio("seq-read-1m.fio", local, size)  # warm the page cache
                record("local_reread_seq", fio("seq-read-1m.fio", local, size)["read"])

        with passthrough(local, work / "pt", keep_cache=False) as pt:
            for _ in range(repeat if "seq" in only else 0):
                fio("seq-read-1m.fio", local, size)  # the source in the page cache
                record("passthrough_warm_seq", fio("seq-read-1m.fio", pt, size)["read"])
            for _ in range(repeat if "tutorial" in only else 0):
                record(
                    "passthrough_tutorial",
                    fio("tutorial-randrw.fio", pt, tut_size, args.runtime)["total"],
                )
        if "seq" in only:
            with passthrough(local, work / "ptk", keep_cache=True) as ptk:
                for _ in range(repeat):
                    fio("seq-read-1m.fio", ptk, size)
                    record(
                        "passthrough_keepcache_reread_seq",
                        fio("seq-read-1m.fio", ptk, size)["read"],
                    )
        shutil.rmtree(local)

        remount = Remount()
        with cachefs_mount(args, work / "cachefs", remount) as mnt:
            bench_dir = mnt / f"fio-compare-{os.getpid()}"
            bench_dir.mkdir()
            try:
                for _ in range(repeat if "seq" in only else 0):
                    # A new file each time: new slices, so its blocks are only on backing storage.
                    with contextlib.suppress(FileNotFoundError):
                        (bench_dir / "seqfile").unlink()
                    record("cachefs_seq_write", fio("seq-write-1m.fio", bench_dir, size)["write"])
                    cold_remounted = remount()
                    drop_caches()
                    record("cachefs_cold_seq", fio("seq-read-1m.fio", bench_dir, size)["read"])
                    drop_caches()
                    record("cachefs_warm_seq", fio("seq-read-1m.fio", bench_dir, size)["read"])
                    record("cachefs_reread_seq", fio("seq-read-1m.fio", bench_dir, size)["read"])
                for _ in range(repeat if "rand" in only else 0):
                    drop_caches()
                    record(
                        "cachefs_rand_4k",
                        fio("rand-read-4k.fio", bench_dir, size, args.runtime)["read"],
                    )
                    drop_caches()
                    record(
                        "cachefs_rand_128k",
                        fio("rand-read-128k.fio", bench_dir, size, args.runtime)["read"],
                    )
                for _ in range(repeat if "tutorial" in only else 0):
                    record(
                        "cachefs_tutorial",
                        fio("tutorial-randrw.fio", bench_dir, tut_size, args.runtime)["total"],
                    )
            finally:
                shutil.rmtree(bench_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {name: round(median(values), 1) for name, values in runs.items()}
    nan = float("nan")
    for name in ("cachefs_cold_seq", "cachefs_warm_seq", "passthrough_warm_seq", "cachefs_reread_seq",
                 "passthrough_keepcache_reread_seq", "cachefs_tutorial", "passthrough_tutorial",
                 "local_reread_seq"):  # fmt: skip
        med.setdefault(name, nan)  # a case left out with --only
    return {
        "size_bytes": size,
        "repeat": repeat,
        "median_mib_s": med,
        "runs_mib_s": {k: [round(v, 1) for v in vs] for k, vs in runs.items()},
        "cold_seq_read_mib_s": med["cachefs_cold_seq"],
        "cold_after_remount": cold_remounted,
        "warm_seq_read_ratio_vs_passthrough": ratio(
            med["cachefs_warm_seq"], med["passthrough_warm_seq"]
        ),
        "reread_seq_ratio_vs_passthrough_keepcache": ratio(
            med["cachefs_reread_seq"], med["passthrough_keepcache_reread_seq"]
        ),
        "tutorial_randrw_ratio_vs_passthrough": ratio(
            med["cachefs_tutorial"], med["passthrough_tutorial"]
        ),
        "reread_seq_ratio_vs_local": ratio(med["cachefs_reread_seq"], med["local_reread_seq"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="fio: cachefs vs a pyfuse3 passthrough vs local disk"
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--mount", help="an existing cachefs mount point")
    where.add_argument(
        "--meta", help="metanode addresses (host:port,...): mount a volume for the run"
    )
    where.add_argument("--lab", action="store_true", help="start a lab cluster (cachefs.lab.cluster) for the run")
    parser.add_argument("--lab-port", type=int, default=26000, help="base port of the --lab cluster")
    parser.add_argument("--volume", default="vol", help="volume to mount with --meta")
    parser.add_argument("--secret-file")
    parser.add_argument("--insecure", action="store_true")
    parser.add_argument("--l1-size", default="1G", help="L1 size of the mount made with --meta")
    parser.add_argument(
        "--size", default="512M", help="file size of the sequential and random jobs"
    )
    parser.add_argument(
        "--tutorial-size", default="64M", help="size per job of the tutorial job (8 jobs)"
    )
    parser.add_argument("--runtime", type=int, default=10, help="seconds cap of the random jobs")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--workdir", default=None, help="local directory for the references (default: /tmp)"
    )
    parser.add_argument(
        "--only",
        type=lambda text: [c for c in text.split(",") if c],
        default=None,
        help=f"comma-separated groups of cases to run ({', '.join(CASES)}; default: all)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.only and set(args.only) - set(CASES):
        parser.error(f"--only takes {', '.join(CASES)}")
    if args.meta and not (args.insecure or args.secret_file):
        parser.error("--meta needs --secret-file or --insecure")
    if os.geteuid() != 0:
        parser.error("needs root (FUSE mounts and drop_caches)")
    if shutil.which("fio") is None:
        parser.error("fio is not installed")
    result = measure(args)

    def show() -> None:
        med = result["median_mib_s"]
        rows = [[name, med[name], len(result["runs_mib_s"].get(name, []))] for name in med]
        print_table("fio, MiB/s (median)", ["case", "MiB/s", "runs"], rows)
        ratios = [
            [k, v]
            for k, v in result.items()
            if k.endswith(("_passthrough", "_keepcache", "_local"))
        ]
        print_table(
            "cachefs vs references", ["ratio", "value"], ratios, note="shared 2-core machine: noisy"
        )

    emit(result, args.json, show)


if __name__ == "__main__":
    main()
