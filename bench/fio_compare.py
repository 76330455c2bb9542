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

The working sets larger than L1 (``--only big,big4``) interleave their
targets (``big_rounds``): each of ``--repeat`` rounds runs every read job on
every target before the next job, so that a drift in the machine's load hits
them alike; medians of the rounds are reported. The ratios in ``--json``
compare cachefs with the references measured in the same run. Needs root (drop_caches, FUSE mounts) and fio.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, emit, median, print_table, ratio

FIO_DIR = Path(__file__).resolve().parent / "fio"
MiB = 1 << 20
# --only: groups of cases (with their references). seq, rand and tutorial use
# --size (default 512M: fits in the mount's L1); big (one file) and big4 (4
# jobs, a file each) use --big-size (default 1G: larger than L1).
CASES = ("seq", "rand", "tutorial", "big", "big4")
BIG_JOBS = 4


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def fio(job: str, directory: Path, size: int, runtime: int = 10, jobs: int = 1,
        **env_extra: str) -> dict[str, float]:  # fmt: skip
    """Run one job file; returns read/write MiB/s and IOPS summed over its jobs.
    Its elapsed time goes to stderr, so that a long run's progress and cost show."""
    env = {**os.environ, "DIR": str(directory), "SIZE": str(size), "RUNTIME": str(runtime),
           "JOBS": str(jobs), **env_extra}  # fmt: skip
    started = time.monotonic()
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
    where = f"{directory.parent.name}/{directory.name}"
    extra = "".join(f" {k}={v}" for k, v in env_extra.items())
    print(f"[fio {time.strftime('%H:%M:%S')}] {job} in {where}, {jobs} x {size >> 20} MiB{extra}: "
          f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    read = sum(j["read"]["bw_bytes"] for j in out["jobs"]) / MiB
    write = sum(j["write"]["bw_bytes"] for j in out["jobs"]) / MiB
    iops = sum(j["read"]["iops"] for j in out["jobs"])
    return {"read": read, "write": write, "total": read + write, "read_iops": iops}


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
    """Unmount and mount again (an empty L1), where this run made the mount;
    ``l2=False``: mount without the L2, so that reads reach the cache tier."""

    def __init__(self) -> None:
        self.fn: Callable[..., None] | None = None

    def __call__(self, l2: bool = True) -> bool:
        if self.fn is None:
            return False
        self.fn(l2=l2)
        return True


@dataclass
class BigTarget:
    """A filesystem the working sets larger than L1 run on: its figures are
    ``PREFIX_big_*`` and ``PREFIX_big4_*``, its files go under ``root`` (a
    directory of its own), ``groups`` says which of big and big4 it runs, and
    ``after_write(group)`` runs between a write and the first read (cachefs: a
    remount, so that L1 holds nothing and the blocks come from L2, as
    JuiceFS's from its disk cache)."""

    prefix: str
    root: Path
    groups: tuple[str, ...] = ("big", "big4")
    after_write: Callable[[str], None] | None = None


# The read jobs of a big case, in order: (figure, fio rw, bs, figure taken from fio's result).
BIG_READS = (("seq_first", "read", "1M", "read"), ("seq_second", "read", "1M", "read"),
             ("rand4k_iops", "randread", "4k", "read_iops"), ("rand128k", "randread", "128k", "read"))


# JuiceFS keeps this share of its cache's disk free (``--free-space-ratio``) and
# stops caching below it: its "disk cache" reads then come over the link.
JUICEFS_FREE_RATIO = 0.1
GiB = 1 << 30


def room_needed(groups: list[str], size: int, repeat: int, caches: list[int], disk_size: int) -> int:
    """Free bytes the big cases need on the work directory's disk for every
    target to measure what it claims: the largest working set on local disk
    and under the passthrough at once; cachefs's datanodes (ec 4+2: 1.5x)
    holding two rounds' files (the metanodes' GC grace, 10 minutes, is about
    a round); each of ``caches`` (capacities: the L2, the cache tier,
    JuiceFS's disk caches) filled with what it sees, up to its capacity; all
    above JuiceFS's free-space floor."""
    if not groups:
        return 0
    sets = [(BIG_JOBS if g == "big4" else 1) * size for g in groups]
    datanodes = int(1.5 * sum(sets)) * min(repeat, 2)
    cached = sum(min(cap, sum(sets) * repeat) for cap in caches)
    return 2 * max(sets) + datanodes + cached + int(JUICEFS_FREE_RATIO * disk_size) + GiB


def check_room(directory: Path, need: int) -> None:
    """Refuse to start when the disk under ``directory`` has less than
    ``need`` bytes free: a JuiceFS cache at its free-space floor reads at the
    link's rate, which would flatter cachefs."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise SystemExit(f"bench: {directory} has {free / GiB:.1f} GiB free; the big cases need "
                         f"{need / GiB:.1f} GiB (working sets, caches and JuiceFS's "
                         f"{JUICEFS_FREE_RATIO:.0%} free-space floor): free space or use smaller --big-size")


def big_rounds(targets: list[BigTarget], groups: list[str], size: int, runtime: int, repeat: int,
               record: Callable[[str, float], None]) -> None:  # fmt: skip
    """The working sets larger than L1: one file of ``size`` (big) or
    ``BIG_JOBS`` files of ``size`` (big4), written, then read with the page
    cache dropped before every job (psync): the first read after the write,
    the second read, random 4 KiB (IOPS) and 128 KiB (MiB/s) with
    ``BIG_JOBS`` jobs. Targets are interleaved: each of ``repeat`` rounds
    writes new files on every target, then runs each job on every target
    before the next job, and starts with the next target than the round
    before, so that a drift in the machine's load hits every target alike
    and the medians compare."""
    for r in range(repeat):
        order = targets[r % len(targets) :] + targets[: r % len(targets)]
        for group in groups:
            files = group == "big4"
            on = [t for t in order if group in t.groups]
            for t in on:
                d = t.root / group
                shutil.rmtree(d, ignore_errors=True)  # new files: cachefs gives them new blocks
                d.mkdir(parents=True)
                job = "files-write-1m.fio" if files else "seq-write-1m.fio"
                record(f"{t.prefix}_{group}_seq_write", fio(job, d, size, jobs=BIG_JOBS if files else 1)["write"])
                if t.after_write is not None:
                    t.after_write(group)
            for name, rw, bs, figure in BIG_READS:
                jobs = BIG_JOBS if files or rw == "randread" else 1
                cap = runtime if rw == "randread" else 3600
                for t in on:
                    drop_caches()
                    if files:
                        out = fio("files-read.fio", t.root / group, size, cap, jobs=jobs, RW=rw, BS=bs)
                    else:
                        job = "seq-read-1m.fio" if rw == "read" else f"rand-read-{bs}.fio"
                        out = fio(job, t.root / group, size, cap, jobs=jobs)
                    record(f"{t.prefix}_{group}_{name}", out[figure])
            for t in on:  # through the target: see passthroughfs._remember
                shutil.rmtree(t.root / group, ignore_errors=True)


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
    l2_opts = ["--cache-dir", str(mountpoint.parent / "l2"), "--cache-size", args.l2_size]
    # stdout: the mount says "cachefs mounted (pid N)", which is not --json
    subprocess.run(cmd + l2_opts, check=True, cwd=REPO, timeout=120, stdout=subprocess.DEVNULL)

    def umount() -> None:
        subprocess.run(
            [sys.executable, "-m", "cachefs.cli", "umount", str(mountpoint)],
            cwd=REPO,
            check=False,
            timeout=180,
        )

    def again(l2: bool = True) -> None:
        umount()
        subprocess.run(
            cmd + (l2_opts if l2 else []),
            check=True,
            cwd=REPO,
            timeout=120,
            stdout=subprocess.DEVNULL,
        )

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

    lab = Lab(LabConfig(root=str(mountpoint.parent / "lab"), base_port=args.lab_port, metrics=False,
                        mount_cache=args.l2_size))  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=180)
        opts = ("--l1-size", args.l1_size, "--no-write-through")
        lab.mount(str(mountpoint), *opts)

        def again(l2: bool = True) -> None:
            lab.umount()
            lab.mount(str(mountpoint), *opts, l2=l2)

        if remount is not None:
            remount.fn = again
        yield mountpoint
    finally:
        lab.down()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    size, repeat = parse_size(args.size), args.repeat
    tut_size = parse_size(args.tutorial_size)
    big = parse_size(args.big_size)
    only = set(getattr(args, "only", None) or CASES)
    cold_remounted = False  # the cold case had an empty L1 (see the module docstring)
    runs: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    groups = [g for g in ("big", "big4") if g in only]
    # the capacities of the caches that keep what they saw: bench.compare names
    # its L2, cache tier and JuiceFS's; a mount made here has its L2
    caches = getattr(args, "big_caches", None)
    if caches is None:
        caches = [parse_size(args.l2_size)] if getattr(args, "l2_size", None) else []
    parent = Path(args.workdir or tempfile.gettempdir())
    disk = os.statvfs(parent)
    check_room(parent, room_needed(groups, big, repeat, caches, disk.f_blocks * disk.f_frsize))
    work = Path(tempfile.mkdtemp(prefix="fio-compare-", dir=args.workdir))
    try:
        local = work / "local"
        local.mkdir()
        if "seq" in only:
            fio("seq-write-1m.fio", local, size)
            for _ in range(repeat):
                fio("seq-read-1m.fio", local, size)  # warm the page cache
                record("local_reread_seq", fio("seq-read-1m.fio", local, size)["read"])
        if "seq" in only:
            with passthrough(local, work / "ptk", keep_cache=True) as ptk:
                for _ in range(repeat):
                    fio("seq-read-1m.fio", ptk, size)
                    record(
                        "passthrough_keepcache_reread_seq",
                        fio("seq-read-1m.fio", ptk, size)["read"],
                    )

        remount = Remount()
        # The passthrough stays mounted beside cachefs: the big cases interleave them.
        with passthrough(local, work / "pt", keep_cache=False) as pt, \
                cachefs_mount(args, work / "cachefs", remount) as mnt:  # fmt: skip
            for _ in range(repeat if "seq" in only else 0):
                fio("seq-read-1m.fio", local, size)  # the source in the page cache
                record("passthrough_warm_seq", fio("seq-read-1m.fio", pt, size)["read"])
            for _ in range(repeat if "tutorial" in only else 0):
                record(
                    "passthrough_tutorial",
                    fio("tutorial-randrw.fio", pt, tut_size, args.runtime)["total"],
                )
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

                def cachefs_after_write(group: str) -> None:
                    """An empty L1 before the first read; for one file first the cold
                    miss path: a mount without L2 reads what the other wrote (cache
                    tier misses, backing storage reads)."""
                    if group == "big" and remount(l2=False):
                        drop_caches()
                        cold = fio("seq-read-1m.fio", bench_dir / "big", big)["read"]
                        record("cachefs_big_seq_cold_tier", cold)
                    remount()

                targets = [
                    BigTarget("passthrough", pt / "pt-big"),
                    BigTarget("local", local / "local-big", groups=("big4",)),
                    BigTarget("cachefs", bench_dir, after_write=cachefs_after_write),
                    *getattr(args, "big_targets", ()),  # bench.compare: JuiceFS
                ]
                big_rounds(targets, groups, big, args.runtime, repeat, record)
            finally:
                shutil.rmtree(bench_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {name: round(median(values), 1) for name, values in runs.items()}
    # The small case is meant to fit in L1: say whether it did (None: the
    # mount is someone else's, its L1 unknown to us).
    l1 = getattr(args, "l1_size", None)
    ours = getattr(args, "meta", None) or getattr(args, "lab", False) or getattr(args, "remount", None)
    fits = size <= parse_size(l1) if l1 and ours else None
    if l1 and ours and big <= parse_size(l1):
        print(f"warning: --big-size {args.big_size} fits in --l1-size {l1}: the big cases measure L1, "
              "not the working set larger than L1 they are meant to", file=sys.stderr)
    nan = float("nan")
    for name in ("cachefs_cold_seq", "cachefs_warm_seq", "passthrough_warm_seq", "cachefs_reread_seq",
                 "passthrough_keepcache_reread_seq", "cachefs_tutorial", "passthrough_tutorial",
                 "local_reread_seq"):  # fmt: skip
        med.setdefault(name, nan)  # a case left out with --only
    def vs(a: str, b: str) -> float:
        return ratio(med.get(a, nan), med.get(b, nan))

    big_ratios = {
        "fio_big_seq_first_vs_passthrough": vs("cachefs_big_seq_first", "passthrough_big_seq_first"),
        "fio_big_seq_second_vs_passthrough": vs("cachefs_big_seq_second", "passthrough_big_seq_second"),
        "fio_big_rand4k_vs_passthrough": vs("cachefs_big_rand4k_iops", "passthrough_big_rand4k_iops"),
        "fio_big_rand128k_vs_passthrough": vs("cachefs_big_rand128k", "passthrough_big_rand128k"),
        "fio_big_seq_cold_tier_vs_passthrough": vs("cachefs_big_seq_cold_tier", "passthrough_big_seq_first"),
        "fio_big4_seq_second_vs_passthrough": vs("cachefs_big4_seq_second", "passthrough_big4_seq_second"),
        "fio_big4_rand4k_vs_passthrough": vs("cachefs_big4_rand4k_iops", "passthrough_big4_rand4k_iops"),
        "fio_big4_rand128k_vs_passthrough": vs("cachefs_big4_rand128k", "passthrough_big4_rand128k"),
    }
    return {
        **big_ratios,
        "size_bytes": size,
        "big_size_bytes": big,
        "small_case_fits_in_l1": fits,
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
    parser.add_argument("--l1-size", default="512M",
                        help="L1 size of the mount made with --meta or --lab (smaller than --big-size)")
    parser.add_argument(
        "--size", default="512M", help="file size of the sequential and random jobs"
    )
    parser.add_argument(
        "--tutorial-size", default="64M", help="size per job of the tutorial job (8 jobs)"
    )
    parser.add_argument(
        "--big-size", default="1G", help="file size of the big and big4 cases (larger than L1)"
    )
    parser.add_argument("--l2-size", default="8G", help="L2 of the mount made with --meta or --lab")
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
            if k.endswith(("_passthrough", "_keepcache", "_local", "_juicefs"))
        ]
        print_table(
            "cachefs vs references", ["ratio", "value"], ratios, note="shared 2-core machine: noisy"
        )

    emit(result, args.json, show)


if __name__ == "__main__":
    main()
