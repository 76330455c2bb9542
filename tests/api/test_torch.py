"""cachefs.client.adapters.torch on a real cluster: every sample exactly once per epoch (shuffled,
several workers, several ranks), and the prefetch reading ahead of the loader."""

from __future__ import annotations

import collections
import os

import pytest

torch = pytest.importorskip("torch")  # the [torch] extra; `make venv` installs it

from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from cachefs.client.adapters.torch import CacheFSDataset, OrderBoard, PrefetchSampler, make_loader  # noqa: E402
from cachefs.client.api import FileSystem  # noqa: E402

N = 96


def _sample_id(data: bytes) -> int:
    """Each file starts with its own index (and is padded to a varying size)."""
    return int(data.split(b":", 1)[0])


@pytest.fixture(scope="module")
def dataset_dir(fs: FileSystem) -> str:
    fs.makedirs("torch/train/a", exist_ok=True)
    fs.makedirs("torch/train/b", exist_ok=True)
    for i in range(N):
        sub = "a" if i % 2 else "b"
        fs.write_bytes(
            f"torch/train/{sub}/{i:04d}.bin", f"{i}:".encode() + os.urandom(1000 + 37 * i)
        )
    return "/torch/train"


def _dataset(lab, source, **kw) -> CacheFSDataset:
    return CacheFSDataset(
        lab.meta_addrs, "lab", source, secret=lab.credential("client"), zone="z1", transform=_sample_id, **kw
    )


def test_directory_listing_and_items(lab, dataset_dir: str) -> None:
    ds = _dataset(lab, dataset_dir)
    try:
        assert len(ds) == N
        assert ds.files == sorted(ds.files) and all(f.startswith("/torch/train/") for f in ds.files)
        ids = [ds[i] for i in range(len(ds))]
        assert sorted(ids) == list(range(N))
        explicit = _dataset(lab, ds.files[:5])
        assert [explicit[i] for i in range(5)] == ids[:5]
        explicit.close()
    finally:
        ds.close()


def _id_and_worker_stats(data: bytes) -> tuple[int, int, int, int]:
    """Runs in the worker: the sample's id and that worker's prefetch counters."""
    info = torch.utils.data.get_worker_info()
    st = info.dataset.stats()
    return _sample_id(data), info.id, st.resyncs, st.hits + st.waits


def test_shuffled_epochs_with_two_workers_yield_each_sample_once(lab, dataset_dir: str) -> None:
    ds = CacheFSDataset(lab.meta_addrs, "lab", dataset_dir, secret=lab.credential("client"), zone="z1",
                        transform=_id_and_worker_stats, prefetch_depth=16)  # fmt: skip
    loader = make_loader(ds, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True,
                         generator=torch.Generator().manual_seed(7))  # fmt: skip
    orders = []
    for _ in range(2):
        seen, ahead = [], {}
        for ids, worker, resyncs, prefetched in loader:
            seen += [int(i) for i in ids]
            assert int(resyncs.max()) == 0  # each worker predicted each of its batches
            ahead[int(worker[0])] = int(prefetched.max())
        assert collections.Counter(seen) == collections.Counter(range(N))
        assert sorted(ahead) == [0, 1] and min(ahead.values()) > 0  # both read ahead
        orders.append(seen)
    assert orders[0] != orders[1] != list(range(N))  # shuffled, differently each epoch
    del loader


def test_workers_forked_after_the_main_process_read(lab, dataset_dir: str) -> None:
    """A dataset that already holds a connection in the main process forks
    into workers that open their own (and leave the parent's alone)."""
    ds = _dataset(lab, dataset_dir, prefetch_depth=8)
    try:
        first = ds[0]
        loader = make_loader(ds, batch_size=16, num_workers=2)
        assert sorted(int(i) for batch in loader for i in batch) == list(range(N))
        assert ds[0] == first  # the main process's connection still works
    finally:
        ds.close()


@pytest.mark.filterwarnings(
    "ignore:This DataLoader will create:UserWarning"
)  # 3 workers on 2 cores
def test_three_workers_uneven_batches_without_persistent_workers(lab, dataset_dir: str) -> None:
    ds = _dataset(lab, dataset_dir, prefetch_depth=8)
    loader = make_loader(ds, batch_size=7, shuffle=True, num_workers=3)  # 96 = 13*7 + 5
    for _ in range(2):
        seen = [int(i) for batch in loader for i in batch]
        assert sorted(seen) == list(range(N))


def test_prefetch_reads_ahead_in_sampler_order(lab, dataset_dir: str) -> None:
    ds = _dataset(lab, dataset_dir, prefetch_depth=24)
    try:
        loader = make_loader(ds, batch_size=6, shuffle=True)  # in this process
        seen = [int(i) for batch in loader for i in batch]
        assert sorted(seen) == list(range(N))
        st = ds.stats()
        # every batch after the first was predicted and read ahead
        assert st.resyncs == 0
        assert st.misses == 6, st
        assert st.hits + st.waits == N - 6, st
        assert st.dropped == 0, st
    finally:
        ds.close()


def test_a_wrong_prediction_costs_reads_not_correctness(lab, dataset_dir: str) -> None:
    """Batches that are not where the worker predicted (a plain loader over a
    sampler the prefetcher was told something else about) still come out right."""
    ds = _dataset(lab, dataset_dir, prefetch_depth=12)
    try:
        sampler = PrefetchSampler(ds, shuffle=True)
        iter(sampler)  # publishes one order...
        loader = DataLoader(ds, batch_size=5, shuffle=True)  # ...the loader uses another
        seen = [int(i) for batch in loader for i in batch]
        assert sorted(seen) == list(range(N))
        assert ds.stats().resyncs > 0
    finally:
        ds.close()


def test_distributed_sampler_ranks_split_the_epoch(lab, dataset_dir: str) -> None:
    ds = _dataset(lab, dataset_dir, prefetch_depth=8)
    per_rank = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        loader = make_loader(ds, batch_size=4, sampler=sampler, num_workers=2)
        loader.sampler.set_epoch(1)
        per_rank.append([int(i) for batch in loader for i in batch])
    assert len(per_rank[0]) == len(per_rank[1]) == N // 2
    assert sorted(per_rank[0] + per_rank[1]) == list(range(N))


def test_order_board_round_trip() -> None:
    board = OrderBoard(10)
    assert board.read() == (0, [])
    board.publish([3, 1, 2])
    assert board.read() == (1, [3, 1, 2])
    board.publish(list(range(12)))  # longer than the board: cut to capacity
    assert board.read() == (2, list(range(10)))


def test_benchmark_case_reports_each_epoch(lab, dataset_dir: str) -> None:
    from bench.native_case import run_native

    rates = run_native(lab.meta_addrs, "lab", dataset_dir, secret=lab.credential("client"), zone="z1", epochs=2, workers=2,
                       batch_size=8)  # fmt: skip
    assert len(rates) == 2 and all(r > 0 for r in rates)
