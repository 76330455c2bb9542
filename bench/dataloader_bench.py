"""Training epochs through a PyTorch DataLoader: how much faster with cachefs, and vs JuiceFS?

    python -m bench.dataloader_bench [--files 2000] [--workers 1,16] [--repeat 1]
                                     [--profiles rtt2ms,rtt10ms] [--quick] [--json]

The published anchor is CubeFS's hybrid-cloud report: with its cache a ResNet18
data pipeline ran 4.6x faster with 1 DataLoader worker and 2.1x with 16, for
GPUs in a public cloud reading a private cluster ~2 ms away. This reproduces
the experiment on one machine: a folder of real JPEG files (Pillow; ~110 KiB,
in class folders) is read by a DataLoader (shuffle on, decode with Pillow,
resize to 224x224, numpy -> tensor) for 2 epochs, with the backing storage of
every remote target behind the emulated WAN link of ``bench.wan``.

Cases (samples/s; each repeated ``--repeat`` times, median and min-max):

- ``direct``  (a) cachefs with the cache tier stopped and L1 off: every read
  goes to the datanodes over the link (what you get without the cache);
  page cache dropped before every epoch;
- ``cold``    (b) cachefs, cache tier just emptied, first epoch;
- ``warm``    (c) cachefs after ``cachefs warmup`` of the dataset, fresh mount,
  page cache dropped;
- ``second``  (d) the epoch after ``cold`` (page cache, L1 and cache tier hot);
- ``local``   (e) local disk, page cache dropped (the ceiling);
- ``juicefs_cold`` / ``juicefs_second`` / ``juicefs_warm`` (f) JuiceFS, S3
  behind the same link, disk cache emptied / second epoch / after
  ``juicefs warmup`` with the page cache dropped.

- ``native`` / ``native_second`` (g) the native API Dataset with
  sampler-aware prefetch (``cachefs.client.adapters.torch.CacheFSDataset``, as in
  bench/native_case.py) with the same decode as a transform, right after
  case (c) (cache tier warm, a fresh client): epoch 1 and epoch 2.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import emit, median, print_table, ratio
from bench.wan import LOCAL, PROFILES, Testbed, drop_page_cache, juicefs_binary

KiB = 1 << 10
CASES = ("direct", "cold", "warm", "second", "local", "juicefs_cold", "juicefs_second", "juicefs_warm",
         "native", "native_second")


# ---------------------------------------------------------------- the dataset

def jpeg_blobs(count: int, target: int = 110 * KiB, seed: int = 7) -> list[bytes]:
    """``count`` distinct JPEG images of about ``target`` bytes (noise over a gradient)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    blobs = []
    side = 330
    for i in range(count):
        for _ in range(6):  # adjust the size until the encoding is near the target
            y, x = np.mgrid[0:side, 0:side]
            base = np.stack([(x + i * 7) % 256, (y + i * 13) % 256, ((x + y) // 2) % 256], axis=-1)
            noise = rng.integers(-40, 40, size=(side, side, 3))
            img = Image.fromarray(np.clip(base + noise, 0, 255).astype("uint8"))
            out = io.BytesIO()
            img.save(out, "JPEG", quality=90)
            size = out.tell()
            if abs(size - target) < target * 0.08:
                break
            side = max(64, int(side * (target / size) ** 0.5))
        blobs.append(out.getvalue())
    return blobs


def write_dataset(root: Path, files: int, classes: int, blobs: list[bytes]) -> int:
    """Class folders of JPEG files; each file unique (a trailer after the JPEG's end marker)."""
    total = 0
    for c in range(classes):
        (root / f"class{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(files):
        data = blobs[i % len(blobs)] + f"cachefs-bench sample {i}".encode()
        path = root / f"class{i % classes:03d}" / f"img{i:06d}.jpg"
        with open(path, "wb") as f:
            f.write(data)
        total += len(data)
    return total


class JpegFolder:
    """A map-style dataset: decode with Pillow, resize to 224x224, numpy -> CHW uint8 tensor."""

    def __init__(self, root: Path) -> None:
        self.files = sorted(str(p) for p in root.glob("class*/*.jpg"))
        self.labels = [int(Path(f).parent.name.removeprefix("class")) for f in self.files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        import numpy as np
        import torch
        from PIL import Image

        with open(self.files[index], "rb") as f:
            data = f.read()
        img = Image.open(io.BytesIO(data)).convert("RGB").resize((224, 224))
        return torch.from_numpy(np.asarray(img).transpose(2, 0, 1).copy()), self.labels[index]


def decode(data: bytes) -> Any:
    """The same transform as :class:`JpegFolder`, for the native Dataset (bytes in)."""
    import numpy as np
    import torch
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB").resize((224, 224))
    return torch.from_numpy(np.asarray(img).transpose(2, 0, 1).copy())


def run_native_epochs(bed: Testbed, directory: str, workers: int, epochs: int, batch_size: int) -> list[float]:
    """Case (g): samples/s of each epoch of cachefs.client.adapters.torch's Dataset (no FUSE, sampler-aware prefetch)."""
    import torch

    from cachefs.client.adapters.torch import CacheFSDataset, make_loader

    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    ds = CacheFSDataset(bed.lab.meta_addrs, "lab", directory, secret=bed.lab.credential("client"), zone="z1",
                        transform=decode)
    loader = make_loader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                         persistent_workers=False, generator=torch.Generator().manual_seed(1))
    rates = []
    try:
        for _ in range(epochs):
            started = time.perf_counter()
            seen = sum(len(batch) for batch in loader)
            rates.append(seen / (time.perf_counter() - started))
    finally:
        del loader
        ds.close()
    return rates


def run_epochs(root: Path, workers: int, epochs: int, batch_size: int,
               before_epoch: Callable[[int], None] | None = None) -> list[float]:
    """Samples/s of each epoch of a shuffled DataLoader over ``root``."""
    import torch
    from torch.utils.data import DataLoader

    dataset = JpegFolder(root)
    if not len(dataset):
        raise RuntimeError(f"no JPEG files under {root}")
    torch.manual_seed(1)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,  # type: ignore[arg-type]
                        persistent_workers=False)
    rates = []
    # torch warns that 16 workers exceed this machine's 2 cores: that is the experiment
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    for epoch in range(epochs):
        if before_epoch is not None:
            before_epoch(epoch)
        started = time.perf_counter()
        seen = 0
        for images, _labels in loader:
            seen += images.shape[0]
        rates.append(seen / (time.perf_counter() - started))
    return rates


# ---------------------------------------------------------------- the cases

def _progress(msg: str) -> None:
    print(f"[dataloader {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _native_case() -> bool:
    """Whether case (g) can run: the native Dataset (cachefs.client.adapters.torch) is there."""
    try:
        import cachefs.client.adapters.torch  # noqa: F401
    except ImportError:
        return False
    return True


def measure(bed: Testbed, args: argparse.Namespace, local_root: Path) -> dict[str, Any]:
    """Every case for every worker count and link profile on a testbed that is up."""
    work = bed.workdir
    cfs_mp = work / "cfs-dl"
    runs: dict[str, dict[str, dict[str, list[float]]]] = {}  # profile -> w<N> -> case -> samples/s

    def record(profile: str, workers: int, case: str, values: list[float]) -> None:
        runs.setdefault(profile, {}).setdefault(f"w{workers}", {}).setdefault(case, []).extend(values)

    blobs = jpeg_blobs(32 if args.quick else 64)
    # Dataset preparation: the link is unconstrained while writing (not what is measured).
    bed.set_link(LOCAL)
    _progress(f"writing {args.files} JPEG files to local disk, cachefs and JuiceFS")
    nbytes = write_dataset(local_root, args.files, args.classes, blobs)
    mnt = bed.mount_cachefs(cfs_mp)
    write_dataset(mnt / "dl", args.files, args.classes, blobs)
    bed.umount_cachefs(mnt)
    jfs_root = None
    if bed.juicefs is not None:
        jfs_root = bed.juicefs.mountpoint / "dl"
        write_dataset(jfs_root, args.files, args.classes, blobs)
        os.sync()

    def drop(_epoch: int = 0) -> None:
        drop_page_cache()

    def epochs(root: Path, workers: int, drop_each: bool) -> list[float]:
        return run_epochs(root, workers, args.epochs, args.batch_size,
                          before_epoch=drop if drop_each else (lambda e: drop() if e == 0 else None))

    for workers in args.workers:
        for _ in range(args.repeat):
            _progress(f"local disk, {workers} workers")
            rates = epochs(local_root, workers, drop_each=False)
            record("local", workers, "local", rates[:1])
            record("local", workers, "local_second", rates[1:])

    for pname in args.profiles:
        profile = PROFILES[pname]
        bed.set_link(profile)
        _progress(f"link {profile.describe()}: cache tier off (case a)")
        bed.cache_tier(False)
        for workers in args.workers:
            for _ in range(args.repeat):
                _progress(f"{pname}: direct (a), {workers} workers")
                mnt = bed.mount_cachefs(cfs_mp, l1_size="0")
                try:
                    record(pname, workers, "direct", epochs(mnt / "dl", workers, drop_each=True))
                finally:
                    bed.umount_cachefs(mnt)
        for workers in args.workers:
            for _ in range(args.repeat):
                _progress(f"{pname}: cold (b) then second epoch (d), {workers} workers")
                bed.cache_tier(True, wipe=True)
                mnt = bed.mount_cachefs(cfs_mp)
                try:
                    rates = epochs(mnt / "dl", workers, drop_each=False)
                finally:
                    bed.umount_cachefs(mnt)
                record(pname, workers, "cold", rates[:1])
                record(pname, workers, "second", rates[1:])
                _progress(f"{pname}: warm (c) after cachefs warmup, {workers} workers")
                bed.cache_tier(True, wipe=True)
                started = time.perf_counter()
                bed.warmup("/dl")
                record(pname, workers, "warmup_s", [time.perf_counter() - started])
                mnt = bed.mount_cachefs(cfs_mp)
                try:
                    record(pname, workers, "warm", epochs(mnt / "dl", workers, drop_each=True)[:1])
                finally:
                    bed.umount_cachefs(mnt)
                if args.native:
                    _progress(f"{pname}: native Dataset (g), {workers} workers")
                    rates = run_native_epochs(bed, "/dl", workers, args.epochs, args.batch_size)
                    record(pname, workers, "native", rates[:1])
                    record(pname, workers, "native_second", rates[1:])
            if bed.juicefs is not None and jfs_root is not None:
                for _ in range(args.repeat):
                    _progress(f"{pname}: JuiceFS cold/second/warm (f), {workers} workers")
                    bed.juicefs.drop_cache()
                    rates = epochs(jfs_root, workers, drop_each=False)
                    record(pname, workers, "juicefs_cold", rates[:1])
                    record(pname, workers, "juicefs_second", rates[1:])
                    bed.juicefs.drop_cache()
                    started = time.perf_counter()
                    bed.juicefs.warmup(jfs_root)
                    record(pname, workers, "juicefs_warmup_s", [time.perf_counter() - started])
                    record(pname, workers, "juicefs_warm", epochs(jfs_root, workers, drop_each=True)[:1])
        bed.cache_tier(True)

    # local disk does not depend on the link: the same figures under every profile
    for pname in args.profiles:
        for w, cases in runs.get("local", {}).items():
            runs[pname].setdefault(w, {}).update(cases)
    runs.pop("local", None)
    return _summarise(runs, args, nbytes, bed)


def _summarise(runs: dict[str, Any], args: argparse.Namespace, nbytes: int, bed: Testbed) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for pname, by_w in runs.items():
        for w, cases in by_w.items():
            for case, values in cases.items():
                table.setdefault(pname, {}).setdefault(w, {})[case] = {
                    "median": round(median(values), 2), "min": round(min(values), 2),
                    "max": round(max(values), 2), "runs": [round(v, 2) for v in values]}

    def med(pname: str, w: int, case: str) -> float:
        return table.get(pname, {}).get(f"w{w}", {}).get(case, {}).get("median", float("nan"))

    result: dict[str, Any] = {
        "files": args.files, "classes": args.classes, "dataset_bytes": nbytes,
        "mean_file_kib": round(nbytes / args.files / KiB, 1), "epochs": args.epochs,
        "batch_size": args.batch_size, "workers": args.workers, "repeat": args.repeat,
        "links": {p: PROFILES[p].describe() for p in args.profiles},
        "juicefs": bed.juicefs.version() if bed.juicefs is not None else None,
        "native_case": ("run: cachefs.client.adapters.torch.CacheFSDataset, the same decode as transform, after case (c)"
                        if args.native else "not run (--no-native, or cachefs.client.adapters.torch is missing)"),
        "samples_per_s": table,
    }
    for pname in args.profiles:
        suffix = "" if pname == "rtt2ms" else f"_{pname}"
        for w in args.workers:
            result[f"speedup_warm_vs_direct_w{w}{suffix}"] = ratio(med(pname, w, "warm"), med(pname, w, "direct"))
            result[f"speedup_second_vs_direct_w{w}{suffix}"] = ratio(med(pname, w, "second"), med(pname, w, "direct"))
            result[f"speedup_cold_vs_direct_w{w}{suffix}"] = ratio(med(pname, w, "cold"), med(pname, w, "direct"))
            result[f"warm_vs_juicefs_w{w}{suffix}"] = ratio(med(pname, w, "warm"), med(pname, w, "juicefs_warm"))
            result[f"cold_vs_juicefs_w{w}{suffix}"] = ratio(med(pname, w, "cold"), med(pname, w, "juicefs_cold"))
            result[f"warm_vs_local_w{w}{suffix}"] = ratio(med(pname, w, "warm"), med(pname, w, "local"))
            if args.native:
                result[f"speedup_native_vs_direct_w{w}{suffix}"] = ratio(med(pname, w, "native"),
                                                                         med(pname, w, "direct"))
                result[f"native_vs_juicefs_w{w}{suffix}"] = ratio(med(pname, w, "native"),
                                                                  med(pname, w, "juicefs_warm"))
    return result


def show(result: dict[str, Any]) -> None:
    for pname, by_w in result["samples_per_s"].items():
        rows = []
        for case in CASES:
            row: list[Any] = [case]
            for w in result["workers"]:
                cell = by_w.get(f"w{w}", {}).get(case)
                row.append(f"{cell['median']:.1f} ({cell['min']:.0f}-{cell['max']:.0f})" if cell else "-")
            rows.append(row)
        print_table(f"DataLoader samples/s, link {result['links'][pname]} (median, min-max)",
                    ["case", *[f"{w} workers" for w in result["workers"]]], rows)
    ratios = [[k, v] for k, v in sorted(result.items())
              if k.startswith(("speedup_", "warm_vs_", "cold_vs_", "native_vs_"))]
    print_table("ratios of samples/s", ["ratio", "value"], ratios,
                note="anchor (CubeFS): 4.6x with 1 worker, 2.1x with 16; shared 2-core machine: noisy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, default=2000, help="JPEG files in the dataset (~110 KiB each)")
    parser.add_argument("--classes", type=int, default=20, help="class folders")
    parser.add_argument("--workers", default="1,16", help="DataLoader worker counts, comma separated")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--no-native", dest="native", action="store_false",
                        help="skip case (g), the native Dataset (cachefs.client.adapters.torch)")
    parser.add_argument("--profiles", default="rtt2ms,rtt10ms",
                        help=f"link profiles ({', '.join(f'{k}: {v.describe()}' for k, v in PROFILES.items())})")


def finish_args(args: argparse.Namespace) -> None:
    args.native = args.native and _native_case()
    args.workers = [int(w) for w in str(args.workers).split(",")]
    args.profiles = [p for p in str(args.profiles).split(",") if p]
    for p in args.profiles:
        if p not in PROFILES:
            raise SystemExit(f"unknown link profile {p!r}; choose from {', '.join(PROFILES)}")
    if args.quick:
        args.files, args.classes, args.epochs = min(args.files, 24), min(args.classes, 4), 2
        args.batch_size, args.profiles = 8, ["rtt2ms"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny dataset, 2 ms link only (smoke test)")
    parser.add_argument("--no-juicefs", action="store_true", help="skip case (f)")
    parser.add_argument("--base-port", type=int, default=27000)
    parser.add_argument("--workdir", default=None, help="where the testbed lives (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    finish_args(args)
    if os.geteuid() != 0:
        parser.error("needs root (FUSE mounts and drop_caches)")
    work = Path(tempfile.mkdtemp(prefix="dataloader-bench-", dir=args.workdir))
    bed = Testbed(work / "bed", args.base_port, with_juicefs=not args.no_juicefs and juicefs_binary() is not None)
    try:
        bed.up()
        result = measure(bed, args, work / "local")
    finally:
        bed.down()
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.json, lambda: show(result))


if __name__ == "__main__":
    main()
