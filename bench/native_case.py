"""Data-loader case (g): the native Dataset with sampler-aware prefetch, beside
the same DataLoader reading the same kind of files through the FUSE mount.

``run_native`` is the case the data-loader benchmark calls; ``run_fuse`` is
its FUSE counterpart (a plain map-style Dataset doing ``open().read()`` on
the mount). Both return samples/s per epoch. Epoch 1 is cold: each case
reads a directory written just before (without write-through), so the cache
tier reads it from backing storage and no client has it in memory; the later
epochs are warm (cache tier, L1, and for FUSE also the kernel page cache).
Workers persist across epochs, as in a training job (epoch 1 includes their
start-up).

``python -m bench.native_case`` starts a lab cluster, mounts it, and runs
both cases for each worker count; the FUSE case is the baseline, measured in
the same run, and the table shows the warm median and the native/FUSE ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import emit, print_table, ratio


def run_native(
    meta_addrs: Sequence[str] | str,
    volume: str,
    directory: str,
    *,
    secret: bytes | str | None,
    zone: str = "",
    epochs: int = 3,
    workers: int = 1,
    batch_size: int = 32,
    prefetch_depth: int = 64,
    shuffle: bool = True,
    seed: int = 0,
) -> list[float]:
    """Samples/s of each epoch of the native Dataset (sampler-aware prefetch)."""
    import torch

    from cachefs.client.adapters.torch import CacheFSDataset, make_loader

    ds = CacheFSDataset(
        meta_addrs, volume, directory, secret=secret, zone=zone, prefetch_depth=prefetch_depth
    )
    loader = make_loader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=workers,
                         persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed))  # fmt: skip
    try:
        return _epochs(loader, epochs)
    finally:
        del loader
        ds.close()


class FilesDataset:
    """The FUSE baseline: sample ``i`` is the bytes of ``files[i]`` on the mount."""

    def __init__(self, root: str | Path) -> None:
        self.files = sorted(str(p) for p in Path(root).rglob("*") if p.is_file())

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> bytes:
        with open(self.files[index], "rb") as f:
            return f.read()


def run_fuse(
    directory: str | Path,
    *,
    epochs: int = 3,
    workers: int = 1,
    batch_size: int = 32,
    shuffle: bool = True,
    seed: int = 0,
) -> list[float]:
    """Samples/s of each epoch of a plain Dataset reading files through a mount."""
    import torch
    from torch.utils.data import DataLoader

    ds = FilesDataset(directory)
    loader: DataLoader[bytes] = DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=workers,  # type: ignore[arg-type]
                        persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed))  # fmt: skip
    try:
        return _epochs(loader, epochs)
    finally:
        del loader


def _epochs(loader: Any, epochs: int) -> list[float]:
    rates = []
    for _ in range(epochs):
        start = time.perf_counter()
        n = sum(len(batch) for batch in loader)
        rates.append(n / (time.perf_counter() - start))
    return rates


# ---------------------------------------------------------------------- standalone run


def _write_set(fs: Any, directory: str, files: int, size: int) -> None:
    fs.makedirs(directory, exist_ok=True)
    blob = os.urandom(size + files)
    for i in range(files):
        fs.write_bytes(f"{directory}/{i:06d}.bin", blob[i : i + size])


def run(files: int, size: int, epochs: int, workers: list[int], batch_size: int) -> dict[str, Any]:
    from cachefs.client.api import connect
    from cachefs.lab.cluster import Lab, LabConfig
    from cachefs.testing.ports import free_lab_base

    root = Path(tempfile.mkdtemp(prefix="cachefs-native-bench-"))
    config = LabConfig(root=str(root / "lab"), metanodes=3, datanodes=3, cachenodes=2, zones=3, policy="ec:2+1",
                       metrics=False, data_capacity="8G", cache_capacity="2G", cache_memory="64M")
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    mnt = root / "mnt"
    result: dict[str, Any] = {
        "files": files,
        "file_size": size,
        "epochs": epochs,
        "batch_size": batch_size,
        "cases": [],
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=120)
        lab.mount(str(mnt))
        with connect(lab.meta_addrs, "lab", secret=lab.credential("client"), zone="z1") as fs:
            for w in workers:
                _write_set(fs, f"bench/fuse-w{w}", files, size)
                _write_set(fs, f"bench/native-w{w}", files, size)
        for w in workers:
            fuse = run_fuse(
                mnt / "bench" / f"fuse-w{w}", epochs=epochs, workers=w, batch_size=batch_size
            )
            native = run_native(lab.meta_addrs, "lab", f"/bench/native-w{w}", secret=lab.credential("client"), zone="z1",
                                epochs=epochs, workers=w, batch_size=batch_size)  # fmt: skip
            result["cases"].append({"workers": w, "fuse": fuse, "native": native})
    finally:
        lab.down(wipe=True)
        if mnt.exists() and not os.path.ismount(mnt):
            mnt.rmdir()
        if root.exists() and not any(root.iterdir()):
            root.rmdir()
    for case in result["cases"]:
        warm_f = statistics.median(case["fuse"][1:]) if epochs > 1 else float("nan")
        warm_n = statistics.median(case["native"][1:]) if epochs > 1 else float("nan")
        case["fuse_warm_median"], case["native_warm_median"] = warm_f, warm_n
        case["warm_ratio"] = ratio(warm_n, warm_f)
        case["cold_ratio"] = ratio(case["native"][0], case["fuse"][0])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--files", type=int, default=512, help="files per data set")
    parser.add_argument("--size", type=int, default=128 << 10, help="bytes per file")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per case (the first is cold)")
    parser.add_argument(
        "--workers", default="1,16", help="DataLoader worker counts, comma separated"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    from cachefs.testing.fuse import fuse_unavailable

    if reason := fuse_unavailable():
        print(f"{reason}: the FUSE baseline mounts the lab", file=sys.stderr)
        return 2
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        r = run(args.files, args.size, args.epochs, workers, args.batch_size)

    def show() -> None:
        rows = []
        for c in r["cases"]:
            rows.append(
                [
                    f"FUSE (baseline), {c['workers']} workers",
                    c["fuse"][0],
                    c["fuse_warm_median"],
                    1.0,
                    1.0,
                ]
            )
            rows.append([f"native + prefetch, {c['workers']} workers", c["native"][0], c["native_warm_median"],
                         c["cold_ratio"], c["warm_ratio"]])  # fmt: skip
        print_table(
            f"data loader: {r['files']} files x {r['file_size'] >> 10} KiB, batch {r['batch_size']}, samples/s",
            ["case", "cold (epoch 1)", "warm (median)", "cold x FUSE", "warm x FUSE"],
            rows,
            note="shared 2-core machine: compare ratios, not absolute rates",
        )

    emit(r, args.json, show)
    return 0


if __name__ == "__main__":
    sys.exit(main())
