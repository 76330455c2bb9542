"""Training epochs over a linked S3 bucket: cachefs against what a user would pick instead.

    python -m bench.repo_bench [--files 400] [--import-objects 2000] [--full] [--workers 4]
                               [--repeat 3] [--profile rtt2ms] [--json]

The same DataLoader workload as ``bench/dataloader_bench.py`` (JPEG files in
class folders, shuffled, decoded with Pillow), stored as objects of a real
S3 server (SeaweedFS) behind the emulated WAN link of ``bench/wan.py``.
Every S3 request of every target crosses that link; setup (putting the
objects, copying into JuiceFS) runs with the link unconstrained.

Cases (samples/s; each repeated ``--repeat`` times, medians):

- ``cold``   cachefs, the bucket linked (``repo link``, full import), cache
  tier emptied, fresh mount, first epoch: every block a ranged GET by a
  cache node;
- ``second`` the epoch right after ``cold``;
- ``warm``   after ``cachefs warmup`` of the linked directory, fresh
  mount, page cache dropped;
- ``rclone_cold`` / ``rclone_second`` / ``rclone_warm``: ``rclone mount
  --vfs-cache-mode full`` of the bucket's prefix (``bench/s3mounts.py``),
  its disk cache emptied and a fresh mount / the next epoch / a fresh
  mount over the cache the two epochs filled, page cache dropped (neither
  peer has a warm-up command: reading is how its cache fills);
- ``s3fs_cold`` / ``s3fs_second`` / ``s3fs_warm``: the same with ``s3fs
  -o use_cache=DIR``;
- ``juicefs_cold`` / ``juicefs_second`` / ``juicefs_warm``: JuiceFS
  (SQLite metadata, its disk cache) whose data lives in the same SeaweedFS
  behind the same link (the dataset copied in first: JuiceFS cannot read
  a bucket's objects as files); cache emptied / second epoch / after
  ``juicefs warmup``, page cache dropped;
- ``boto3``  the DataLoader's dataset reading each object with boto3
  ``get_object`` (no cache: every epoch is this);
- ``local``  local disk, page cache dropped (the ceiling).

The best peer is the better of rclone and s3fs in each case, as the issue
says (both Debian packages, installed when missing); JuiceFS and boto3
are reported beside (``repo_*_vs_juicefs``).
``ranged_get_cpu_ms``: this process's CPU per GET of one dataset object,
8 in flight, through the cache node's miss path (obstore) and through
boto3, the link unconstrained.
``import_s``: ``cachefs repo link`` of ``--import-objects`` objects (in 100
prefixes) over the link, the CLI's start-up included. ``--full`` is the
issue's size: 2,000 files and a 100,000-object import
(``repo_import_100k_s``; null when another count was imported: no
extrapolation).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.common import REPO, median, print_table, ratio
from bench.dataloader_bench import JpegFolder, jpeg_blobs, run_epochs, write_dataset
from bench.s3mounts import Rclone, S3fs, S3Mount, ensure_apt_packages
from bench.wan import LOCAL, PROFILES, JuiceFS, Testbed, drop_page_cache, run_on_testbed
from cachefs.testing.ports import free_port
from cachefs.testing.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3, credentials_env

BUCKET = "train"
PEERS = ("rclone", "s3fs")
CASES = ("cold", "second", "warm", *(f"{p}_{c}" for p in (*PEERS, "juicefs") for c in ("cold", "second", "warm")),
         "boto3", "local")


def _progress(msg: str) -> None:
    print(f"[repo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class SeaweedJuiceFS(JuiceFS):
    """JuiceFS on the SeaweedFS bucket (its identity's keys, not moto's any-key)."""

    def format(self) -> None:
        self._run("format", "--storage", "s3", "--bucket", self.bucket_url, "--access-key", ACCESS_KEY,
                  "--secret-key", SECRET_KEY, "--trash-days", "0", self.meta, "bench")


class RepoTestbed(Testbed):
    """bench.wan's testbed with SeaweedFS (not moto) behind the link, for the linked
    bucket, rclone's and s3fs's mounts of it and JuiceFS's data alike."""

    def __init__(self, workdir: Path, base_port: int, with_juicefs: bool = True) -> None:
        super().__init__(workdir, base_port, with_juicefs=False, cachenodes=1)
        self.weed = SeaweedS3(workdir / "weed")
        self.s3_relay_port = free_port()
        self.with_jfs = with_juicefs
        self.peers: dict[str, S3Mount] = {}

    @property
    def s3_url(self) -> str:
        """The bucket's endpoint as every target sees it: through the link."""
        return f"http://127.0.0.1:{self.s3_relay_port}"

    def up(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.weed.start()
        self.relay.routes[self.s3_relay_port] = f"127.0.0.1:{self.weed.ports['s3.port']}"
        os.environ.update(credentials_env())  # the lab's nodes read the bucket with it, as on a real host
        super().up()
        self.client().create_bucket(Bucket=BUCKET)
        if self.with_jfs:
            self.client().create_bucket(Bucket="jfsbench")
            self.juicefs = SeaweedJuiceFS(self.workdir, f"{self.s3_url}/jfsbench")
            self.juicefs.format()
            self.juicefs.mount()
        ensure_apt_packages(*PEERS)
        for peer in (Rclone, S3fs):
            self.peers[peer.name] = peer(self.workdir, self.s3_url, BUCKET, "dl", ACCESS_KEY, SECRET_KEY)

    def down(self) -> None:
        try:
            for peer in self.peers.values():
                peer.umount()
            super().down()
        finally:
            self.weed.stop()

    def client(self, endpoint: str = "") -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.weed.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def repo(self, *args: str) -> dict[str, Any]:
        argv = [sys.executable, "-m", "cachefs.cli", "repo", *args, "--meta", ",".join(self.lab.meta_addrs),
                "--secret-file", str(self.lab.credential_file("admin")), "--json"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"cachefs repo {args[0]} failed: {proc.stderr.strip()[-1500:]}")
        return json.loads(proc.stdout)


class S3JpegFolder(JpegFolder):
    """The same dataset read with boto3 ``get_object`` (one client per DataLoader worker)."""

    def __init__(self, endpoint: str, keys: list[str]) -> None:
        self.endpoint = endpoint
        self.files = keys
        self.labels = [int(k.split("/")[1].removeprefix("class")) for k in keys]
        self._client: Any = None

    def __getitem__(self, index: int) -> tuple[Any, int]:
        import io

        import boto3
        import numpy as np
        import torch
        from PIL import Image

        if self._client is None:
            self._client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                                        aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
        data = self._client.get_object(Bucket=BUCKET, Key=self.files[index])["Body"].read()
        img = Image.open(io.BytesIO(data)).convert("RGB").resize((224, 224))
        return torch.from_numpy(np.asarray(img).transpose(2, 0, 1).copy()), self.labels[index]


def boto3_epoch(endpoint: str, keys: list[str], workers: int, batch_size: int) -> float:
    import torch
    from torch.utils.data import DataLoader

    torch.manual_seed(1)
    loader = DataLoader(S3JpegFolder(endpoint, keys), batch_size=batch_size, shuffle=True,  # type: ignore[arg-type]
                        num_workers=workers, persistent_workers=False)
    started = time.perf_counter()
    seen = sum(images.shape[0] for images, _labels in loader)
    return seen / (time.perf_counter() - started)


def put_objects(endpoint: str, items: Iterable[tuple[str, bytes]], bucket: str = BUCKET) -> None:
    """Put ``items`` (key, body) 16 at a time, one boto3 client per thread (a
    client per put made filling 100,000 objects take 744 s)."""
    import boto3

    local = threading.local()

    def put(item: tuple[str, bytes]) -> None:
        if not hasattr(local, "client"):
            local.client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                                        aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
        local.client.put_object(Bucket=bucket, Key=item[0], Body=item[1])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for _ in pool.map(put, items):
            pass


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def ranged_get_cpu_ms(endpoint: str, keys: list[str], rounds: int = 3) -> dict[str, float]:
    """This process's CPU per whole-object GET of ``keys``, 8 in flight: the
    cache node's miss path (``S3Store.get_range``, obstore) against boto3's
    ``get_object`` in threads, the client a user would write. Medians of
    ``rounds``; the first pass of each opens the connections, not measured."""
    import boto3
    import trio

    from cachefs.repo.s3 import S3Store

    store = S3Store(BUCKET, name="bench link", endpoint=endpoint)
    sizes: dict[str, int] = {}
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
    for key in keys:
        sizes[key] = client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]

    async def obstore_pass() -> None:
        limit = trio.Semaphore(8)

        async def one(key: str) -> None:
            async with limit:
                await store.get_range(key, 0, sizes[key], "")

        async with trio.open_nursery() as n:
            for key in keys:
                n.start_soon(one, key)

    def boto3_pass() -> None:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for _ in pool.map(lambda k: client.get_object(Bucket=BUCKET, Key=k)["Body"].read(), keys):
                pass

    def per_get(run: Any) -> float:
        run()
        samples = []
        for _ in range(rounds):
            before = _cpu()
            run()
            samples.append((_cpu() - before) / len(keys) * 1000)
        return round(median(samples), 3)

    return {"obstore": per_get(lambda: trio.run(obstore_pass)), "boto3": per_get(boto3_pass)}


def measure(bed: RepoTestbed, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    runs: dict[str, list[float]] = {case: [] for case in CASES}
    profile = PROFILES[args.profile]
    blobs = jpeg_blobs(64)
    local = work / "local"
    _progress(f"writing {args.files} JPEG files to local disk, the bucket and JuiceFS")
    nbytes = write_dataset(local, args.files, args.classes, blobs)
    files = sorted(local.rglob("*.jpg"))
    keys = [f"dl/{p.relative_to(local)}" for p in files]
    put_objects(bed.weed.endpoint, [(k, p.read_bytes()) for k, p in zip(keys, files, strict=True)])
    jfs_root = None
    if bed.juicefs is not None:
        jfs_root = bed.juicefs.mountpoint / "dl"
        write_dataset(jfs_root, args.files, args.classes, blobs)
        os.sync()
    link = bed.repo("link", "lab", "/repo", f"s3://{BUCKET}/dl", "--endpoint", bed.s3_url)
    assert link["import"]["created"] == args.files, link

    def epochs(root: Path, n: int, drop_first: bool = True) -> list[float]:
        return run_epochs(root, args.workers, n, args.batch_size,
                          before_epoch=lambda e: drop_page_cache() if e == 0 and drop_first else None)

    for _ in range(args.repeat):
        runs["local"] += epochs(local, 1)
    _progress("CPU per ranged GET, obstore and boto3 (link unconstrained)")
    get_cpu = ranged_get_cpu_ms(bed.weed.endpoint, keys)  # credentials: the testbed's environment
    bed.set_link(profile)
    mp = work / "cfs"
    for i in range(args.repeat):
        _progress(f"link {profile.describe()}: run {i + 1} of {args.repeat}")
        bed.cache_tier(True, wipe=True)
        mnt = bed.mount_cachefs(mp)
        try:
            cold, second = epochs(mnt / "repo", 2)
        finally:
            bed.umount_cachefs(mnt)
        runs["cold"].append(cold)
        runs["second"].append(second)
        bed.cache_tier(True, wipe=True)
        bed.warmup("/repo")
        mnt = bed.mount_cachefs(mp)
        try:
            runs["warm"] += epochs(mnt / "repo", 1)
        finally:
            bed.umount_cachefs(mnt)
        runs["boto3"].append(boto3_epoch(bed.s3_url, keys, args.workers, args.batch_size))
        for name, peer in bed.peers.items():
            peer.drop_cache()
            cold, second = epochs(peer.mountpoint, 2)
            peer.remount()
            runs[f"{name}_cold"].append(cold)
            runs[f"{name}_second"].append(second)
            runs[f"{name}_warm"] += epochs(peer.mountpoint, 1)
        if bed.juicefs is not None and jfs_root is not None:
            bed.juicefs.drop_cache()
            cold, second = epochs(jfs_root, 2)
            runs["juicefs_cold"].append(cold)
            runs["juicefs_second"].append(second)
            bed.juicefs.drop_cache()
            bed.juicefs.warmup(jfs_root)
            runs["juicefs_warm"] += epochs(jfs_root, 1)

    bed.set_link(LOCAL)  # setup, not measured
    _progress(f"putting {args.import_objects:,} objects to import")
    put_objects(bed.weed.endpoint, ((f"imp/p{i % 100:02d}/o{i:06d}", b"x") for i in range(args.import_objects)))
    bed.set_link(profile)
    started = time.perf_counter()
    imported = bed.repo("link", "lab", "/imported", f"s3://{BUCKET}/imp", "--endpoint", bed.s3_url)
    import_s = time.perf_counter() - started
    assert imported["import"]["created"] == args.import_objects, imported
    result = summarise(runs, args, nbytes, import_s, bed)
    result["ranged_get_cpu_ms"] = get_cpu
    return result


def summarise(runs: dict[str, list[float]], args: argparse.Namespace, nbytes: int, import_s: float,
              bed: RepoTestbed) -> dict[str, Any]:  # fmt: skip
    med = {case: round(median(values), 2) for case, values in runs.items() if values}
    best = {case: max(PEERS, key=lambda p: med[f"{p}_{case}"]) for case in ("cold", "second", "warm")}
    jfs = {case: ratio(med[case], med[f"juicefs_{case}"]) if f"juicefs_{case}" in med else None
           for case in ("cold", "second", "warm")}
    return {
        "files": args.files, "classes": args.classes, "dataset_bytes": nbytes, "workers": args.workers,
        "batch_size": args.batch_size, "repeat": args.repeat, "link": PROFILES[args.profile].describe(),
        "s3": "SeaweedFS", "juicefs": bed.juicefs.version() if bed.juicefs is not None else None,
        "peers": {name: peer.version() for name, peer in bed.peers.items()}, "best_peer": best,
        "samples_per_s": {case: {"median": med[case], "runs": [round(v, 2) for v in values]}
                          for case, values in runs.items() if values},
        "repo_warm_vs_best_peer": ratio(med["warm"], med[f"{best['warm']}_warm"]),
        "repo_cold_vs_best_peer": ratio(med["cold"], med[f"{best['cold']}_cold"]),
        "repo_warm_vs_local": ratio(med["warm"], med["local"]),
        "repo_second_vs_best_peer": ratio(med["second"], med[f"{best['second']}_second"]),
        "repo_warm_vs_juicefs": jfs["warm"], "repo_cold_vs_juicefs": jfs["cold"],
        "repo_second_vs_juicefs": jfs["second"], "repo_warm_vs_boto3": ratio(med["warm"], med["boto3"]),
        "repo_import_objects": args.import_objects,
        "repo_import_s": round(import_s, 2),
        "repo_import_100k_s": round(import_s, 2) if args.import_objects == 100_000 else None,
    }


def show(result: dict[str, Any]) -> None:
    rows = [[case, cell["median"], " ".join(f"{v:.0f}" for v in cell["runs"])]
            for case, cell in result["samples_per_s"].items()]
    print_table(f"DataLoader samples/s over a linked bucket, link {result['link']}", ["case", "median", "runs"], rows)
    print_table("ratios", ["ratio", "value"], [[k, v] for k, v in sorted(result.items()) if k.startswith("repo_")],
                note="best peer: the better of rclone and s3fs. aims: warm >= 2x it and >= 0.9x local; cold >= 1x; 100k objects in <= 30 s")
    if "ranged_get_cpu_ms" in result:
        print_table("CPU per ranged GET of one object (ms, this process)", ["client", "ms"],
                    [[k, v] for k, v in result["ranged_get_cpu_ms"].items()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=400, help="JPEG files in the dataset (~110 KiB each)")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--import-objects", type=int, default=2000, help="objects of the import timing")
    parser.add_argument("--full", action="store_true", help="the issue's size: 2,000 files, 100,000 objects")
    parser.add_argument("--workers", type=int, default=4, help="DataLoader workers")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", default="rtt2ms", choices=sorted(PROFILES))
    parser.add_argument("--no-juicefs", action="store_true")
    parser.add_argument("--base-port", type=int, default=27600)
    parser.add_argument("--workdir", default=None, help="where the testbed lives (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.full:
        args.files, args.classes, args.import_objects = 2000, 20, 100_000
    if os.geteuid() != 0:
        parser.error("needs root (FUSE mounts and drop_caches)")
    run_on_testbed(args, "repo-bench-", measure, show, with_juicefs=not args.no_juicefs, testbed=RepoTestbed)

if __name__ == "__main__":
    main()
