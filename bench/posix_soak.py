"""fsx, pjdfstest and seek_sanity_test against a fresh lab mount, by hand (issue 16's conformance runs).

    python -m bench.posix_soak --fsx PATH [--fsx-ops 20000] [--pjdfstest DIR] [--seek-sanity PATH] [--keep]

None of these is packaged for Debian 12 and this machine reaches no source
host, so they are built by hand elsewhere and named here: ``--fsx`` an fsx
binary (xfstests' ``ltp/fsx``, or LTP's), ``--pjdfstest`` a built
pjdfstest checkout (its ``pjdfstest`` binary and ``tests/``; run under
``prove``, as root), ``--seek-sanity`` xfstests' ``src/seek_sanity_test``
(the body of generic/285 and generic/436: SEEK_DATA and SEEK_HOLE over
holes, dirty and unwritten pages, and files of 8 GiB to 16 TiB). The
script starts a lab of its own (3 metanodes, 3 datanodes, 2 cache nodes,
ec:2+1, free ports, a fresh directory), mounts
its volume, runs fsx in a directory of the mount (a seeded run of
``--fsx-ops`` operations through read/write, no mmap; fsx probes the
fallocate modes itself and leaves out those the mount rejects, as
COLLAPSE_RANGE and INSERT_RANGE), pjdfstest and seek_sanity_test each
in another, prints each tool's verdict and the tail of its output,
unmounts and takes the lab down. Exit status 0 when every tool that ran passed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cachefs.lab.cluster import Lab, LabConfig
from cachefs.testing.ports import free_lab_base

TAIL = 40  # lines of each tool's output shown


def run(argv: list[str], cwd: Path, timeout: float) -> tuple[bool, str]:
    print(f"$ {' '.join(argv)}  (in {cwd})", flush=True)
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return False, f"{out}\n(timed out after {timeout:.0f}s)"
    return proc.returncode == 0, proc.stdout + proc.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fsx", help="an fsx binary")
    ap.add_argument("--fsx-ops", type=int, default=20000)
    ap.add_argument("--fsx-seed", type=int, default=1)
    ap.add_argument("--pjdfstest", help="a built pjdfstest checkout")
    ap.add_argument("--seek-sanity", help="xfstests' src/seek_sanity_test binary")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per tool")
    ap.add_argument("--keep", action="store_true", help="keep the lab directory (logs) afterwards")
    args = ap.parse_args()
    if not (args.fsx or args.pjdfstest or args.seek_sanity):
        ap.error("nothing to run: give --fsx, --pjdfstest or --seek-sanity")
    if args.pjdfstest and not shutil.which("prove"):
        ap.error("pjdfstest runs under prove (Debian: perl)")
    root = Path(tempfile.mkdtemp(prefix="cachefs-soak-"))
    root.chmod(0o755)  # pjdfstest works as other users too: they must reach the mount point
    config = LabConfig(root=str(root / "lab"), metanodes=3, datanodes=3, cachenodes=2, zones=3, policy="ec:2+1",
                       metrics=False, data_capacity="8G", cache_capacity="2G", cache_memory="32M")  # fmt: skip
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    mnt = root / "mnt"
    mnt.mkdir()
    verdicts: dict[str, bool] = {}
    lab.up(timeout=120)
    try:
        mount = [sys.executable, "-m", "cachefs.cli", "mount", ",".join(lab.meta_addrs), "lab", str(mnt), "-d",
                 "--secret-file", str(lab.secret_file), "--log-file", str(root / "mount.log"), "--zone", "z1",
                 "--allow-other"]  # fmt: skip  # pjdfstest's other users, under the kernel's permission checks
        subprocess.run(mount, check=True, timeout=120)
        try:
            if args.fsx:
                work = mnt / "fsx"
                work.mkdir()
                # -N ops, -S seed, -R -W: no mmap reads/writes, -l: file length bound.
                argv = [args.fsx, "-N", str(args.fsx_ops), "-S", str(args.fsx_seed), "-R", "-W", "-l", str(4 << 20),
                        str(work / "fsx.file")]  # fmt: skip
                ok, out = run(argv, work, args.timeout)
                verdicts["fsx"] = ok
                print("\n".join(out.splitlines()[-TAIL:]))
            if args.pjdfstest:
                work = mnt / "pjdfstest"
                work.mkdir()
                tests = Path(args.pjdfstest).resolve() / "tests"
                ok, out = run(["prove", "-r", str(tests)], work, args.timeout)
                verdicts["pjdfstest"] = ok
                print("\n".join(out.splitlines()[-TAIL:]))
            if args.seek_sanity:
                work = mnt / "seek"
                work.mkdir()
                ok, out = run([args.seek_sanity, str(work / "seek.file")], work, args.timeout)
                verdicts["seek_sanity_test"] = ok and "fail" not in out.lower()
                print("\n".join(out.splitlines()[-TAIL:]))
        finally:
            subprocess.run([sys.executable, "-m", "cachefs.cli", "umount", str(mnt)], check=False, timeout=180)
    finally:
        lab.down()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    for tool, ok in verdicts.items():
        print(f"{tool}: {'passed' if ok else 'FAILED'}")
    if args.keep:
        print(f"lab directory and mount log: {root}")
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
