"""PyTorch Dataset over a cachefs directory, with sampler-aware prefetch.

Why: a DataLoader worker asks for one batch at a time, so each batch pays
the full latency of its file reads. CubeFS's AI plugin and 3FS's native API
load the *next* batches' files into memory while the current one is being
used; that needs to know the order, which only the sampler has.

How the order reaches the workers
---------------------------------
:class:`PrefetchSampler` wraps any sampler (``RandomSampler``,
``SequentialSampler``, ``DistributedSampler``...). Each time the DataLoader
starts an epoch it draws the epoch's whole order from the wrapped sampler and
publishes it in a small shared-memory array (:class:`OrderBoard`, created
before the workers fork and handed to them inside the dataset) with a new
generation number, then yields it unchanged. Every index reaches a worker
after the order holding it was published, so a worker that sees a new
generation knows the whole epoch.

The DataLoader hands batches to its ``W`` workers round-robin, starting
again at worker 0 each epoch (``in_order=True``, the default): worker ``w``
gets batches ``w, w+W, w+2W...``. A worker therefore predicts its own next
indices (the next ``prefetch_depth`` samples of its coming batches), and its
:class:`Prefetcher` reads those files in parallel into memory on the worker's
own cachefs client (one connection per worker process, opened lazily in it)
while the training step runs. The prediction is checked at every batch (the
batch must sit where it was predicted; if not, the worker finds it in the
order and carries on from there) and is only ever a hint: a file that was not
prefetched is read when asked for, and one prefetched for nothing is dropped.
So correctness never depends on the dispatch pattern, only speed does.

Without a :class:`PrefetchSampler` the dataset still reads each batch's files
in parallel (``__getitems__``), just not ahead.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.data
import trio
from torch.utils.data import Sampler

from cachefs.client.api import AsyncFileSystem, ClientOptions, FileSystem, client_tls, connect
from cachefs.credentials import Credential

log = logging.getLogger(__name__)

WORKER_L1 = 64 << 20  # per worker: the prefetch store holds the samples already


class OrderBoard:
    """The current epoch's sample order, shared with the DataLoader workers.

    Layout of the int64 array: ``[generation, length, order...]``. Written only
    by the process that iterates the sampler, read by the workers; the order is
    written before the generation, and a reader takes it only after seeing the
    generation change, then checks the generation again.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._arr = multiprocessing.RawArray("q", capacity + 2)

    def publish(self, order: Sequence[int]) -> None:
        n = min(len(order), self.capacity)
        self._arr[2 : 2 + n] = list(order[:n])
        self._arr[1] = n
        self._arr[0] = self._arr[0] + 1

    @property
    def generation(self) -> int:
        return int(self._arr[0])

    def read(self) -> tuple[int, list[int]]:
        """``(generation, order)``; generation 0 means nothing published yet."""
        while True:
            gen = int(self._arr[0])
            order = list(self._arr[2 : 2 + int(self._arr[1])])
            if int(self._arr[0]) == gen:
                return gen, order


class PrefetchSampler(Sampler[int]):
    """Wraps ``base`` and tells ``dataset`` each epoch's order (see module docstring)."""

    def __init__(self, dataset: CacheFSDataset, base: Sampler[int] | None = None, *, shuffle: bool = False,
                 generator: torch.Generator | None = None) -> None:  # fmt: skip
        if base is None:
            base = (
                torch.utils.data.RandomSampler(dataset, generator=generator)
                if shuffle
                else torch.utils.data.SequentialSampler(dataset)
            )
        self.base = base
        self.board = dataset.attach_board(len(base))  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        order = [int(i) for i in self.base]
        self.board.publish(order)
        return iter(order)

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the wrapped sampler (``DistributedSampler`` needs it)."""
        set_epoch = getattr(self.base, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)


@dataclass
class PrefetchStats:
    hits: int = 0  # asked for and already in memory
    waits: int = 0  # asked for while its prefetch was still in flight
    misses: int = 0  # asked for and not prefetched: read then
    prefetched: int = 0
    dropped: int = 0  # prefetched and then not wanted (a wrong prediction)
    resyncs: int = 0  # batches that were not where the worker predicted


@dataclass
class Prefetcher:
    """Files kept ready in memory for one process; lives on its client's trio loop.

    ``step(batch, window)`` returns the batch's bytes and keeps ``window`` (the
    predicted next paths) in flight: at most ``parallel`` reads at once, and
    no new one starts while ``max_bytes`` are held (sizes are known only once
    read, so the reads in flight may add up to ``parallel`` files more). Everything not in the window is dropped, so a
    wrong prediction costs reads, never memory.
    """

    afs: AsyncFileSystem
    parallel: int = 16
    max_bytes: int = 256 << 20
    stats: PrefetchStats = field(default_factory=PrefetchStats)

    def __post_init__(self) -> None:
        self._ready: dict[str, bytes] = {}
        self._inflight: dict[str, trio.Event] = {}
        self._wanted: set[str] = set()
        self._held = 0
        self._limit = trio.Semaphore(self.parallel)

    async def step(self, batch: list[str], window: list[str]) -> list[bytes]:
        self._want(window, keep=batch)
        out: list[bytes | None] = [None] * len(batch)

        async def one(i: int, path: str) -> None:
            out[i] = await self._take(path)

        if len(batch) == 1:
            await one(0, batch[0])
        else:
            async with trio.open_nursery() as nursery:
                for i, path in enumerate(batch):
                    nursery.start_soon(one, i, path)
        return out  # type: ignore[return-value]

    def _want(self, window: list[str], keep: list[str]) -> None:
        self._wanted = set(window) | set(keep)
        for path in [p for p in self._ready if p not in self._wanted]:
            self._held -= len(self._ready.pop(path))
            self.stats.dropped += 1
        for path in window:
            if self._held >= self.max_bytes:
                break
            if path not in self._ready and path not in self._inflight:
                self._inflight[path] = trio.Event()
                self.afs.start_soon(self._fetch, path)

    async def _fetch(self, path: str) -> None:
        event = self._inflight[path]
        try:
            async with self._limit:
                if path not in self._wanted:
                    return
                data = await self.afs.read_bytes(path)
            if path in self._wanted:
                self._ready[path] = data
                self._held += len(data)
                self.stats.prefetched += 1
        except OSError as exc:
            log.debug("prefetch of %s failed (read again when asked): %s", path, exc)
        finally:
            del self._inflight[path]
            event.set()

    async def _take(self, path: str) -> bytes:
        event = self._inflight.get(path)
        if event is not None:
            self.stats.waits += 1
            await event.wait()
        data = self._ready.pop(path, None)
        if data is None:
            if event is None:
                self.stats.misses += 1
            return await self.afs.read_bytes(path)
        self._held -= len(data)
        if event is None:
            self.stats.hits += 1
        return data


class _Worker:
    """Per-process state: the client, the prefetcher and where we are in the order."""

    def __init__(self, fs: FileSystem, prefetcher: Prefetcher) -> None:
        self.fs = fs
        self.prefetcher = prefetcher
        self.generation = 0
        self.order: list[int] = []
        self.position: dict[int, int] = {}
        self.cursor = -1  # where in the order this worker's next batch should start

    def close(self) -> None:
        self.fs.close()


class CacheFSDataset(torch.utils.data.Dataset[Any]):
    """Map-style dataset: sample ``i`` is ``transform(bytes of files[i])``.

    ``source`` is a directory of the volume (every regular file under it, in
    sorted path order) or a list of file paths. Each process reading samples
    (the main one, or each DataLoader worker) opens its own connection on
    first use; the dataset itself pickles without one (so TLS material is
    given as file paths, ``tls_cert``/``tls_key``/``tls_ca`` as for the mount,
    and each process loads them; ``token`` is the volume's mount token).
    """

    def __init__(
        self,
        meta: Sequence[str] | str,
        volume: str,
        source: str | Sequence[str],
        *,
        secret: bytes | str | Credential | None = None,
        zone: str = "",
        transform: Callable[[bytes], Any] | None = None,
        prefetch_depth: int = 64,
        prefetch_parallel: int = 16,
        prefetch_bytes: int = 256 << 20,
        options: ClientOptions | None = None,
        token: str | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self.meta = list(meta.split(",")) if isinstance(meta, str) else list(meta)
        self.volume = volume
        self.secret = secret
        self.token = token
        self.tls_files = {"tls_cert": tls_cert, "tls_key": tls_key, "tls_ca": tls_ca}
        client_tls(**self.tls_files)  # an incomplete set fails here, not in a worker
        self.zone = zone
        self.transform = transform
        self.prefetch_depth = prefetch_depth
        self.prefetch_parallel = prefetch_parallel
        self.prefetch_bytes = prefetch_bytes
        self.options = options or ClientOptions(l1_bytes=WORKER_L1)
        self.board: OrderBoard | None = None
        self._worker: _Worker | None = None
        self._worker_pid = 0
        if isinstance(source, str):
            with self._connect() as fs:
                self.files = sorted(
                    f"{top.rstrip('/')}/{name}"
                    for top, _, names in fs.walk(source)
                    for name in names
                )
        else:
            self.files = [str(p) for p in source]

    def _connect(self) -> FileSystem:
        return connect(
            self.meta, self.volume, secret=self.secret, zone=self.zone, options=self.options,
            token=self.token, **self.tls_files,
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.files)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_worker"] = None
        state["_worker_pid"] = 0
        return state

    def attach_board(self, capacity: int) -> OrderBoard:
        """The shared order array a :class:`PrefetchSampler` publishes into;
        must exist before the DataLoader starts its workers."""
        if self.board is None or self.board.capacity < capacity:
            self.board = OrderBoard(capacity)
        return self.board

    def worker(self) -> _Worker:
        """This process's client and prefetcher (made on first use, again after fork)."""
        if self._worker is None or self._worker_pid != os.getpid():
            fs = self._connect()
            prefetcher = Prefetcher(fs.aio, self.prefetch_parallel, self.prefetch_bytes)
            self._worker, self._worker_pid = _Worker(fs, prefetcher), os.getpid()
            if torch.utils.data.get_worker_info() is not None:
                # DataLoader workers leave through multiprocessing's exit path,
                # which runs these finalizers but not atexit: end the session.
                multiprocessing.util.Finalize(self._worker, self._worker.close, exitpriority=10)
        return self._worker

    def close(self) -> None:
        """End this process's connection (a later read opens a new one)."""
        if self._worker is not None and self._worker_pid == os.getpid():
            self._worker.close()
        self._worker = None

    def stats(self) -> PrefetchStats:
        """This process's prefetch counters."""
        return self.worker().prefetcher.stats

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """One batch: its files read in parallel (from memory when prefetched)."""
        w = self.worker()
        idx = [int(i) for i in indices]
        window = self._predict(w, idx)
        batch = [self.files[i] for i in idx]
        paths = [self.files[i] for i in window]
        data = w.fs.call(w.prefetcher.step, batch, paths)
        if self.transform is None:
            return data
        return [self.transform(d) for d in data]

    def _predict(self, w: _Worker, batch: list[int]) -> list[int]:
        """The next ``prefetch_depth`` indices this worker will be asked for."""
        board = self.board
        if board is None or not batch or self.prefetch_depth <= 0:
            return []
        info = torch.utils.data.get_worker_info()
        wid, nworkers = (info.id, info.num_workers) if info is not None else (0, 1)
        if board.generation != w.generation:
            w.generation, w.order = board.read()
            w.position = {}
            w.cursor = wid * len(batch)
        order, size = w.order, len(batch)
        if order[w.cursor : w.cursor + size] != batch:
            w.prefetcher.stats.resyncs += 1
            if not w.position:
                w.position = {}
                for pos, i in enumerate(order):
                    w.position.setdefault(i, pos)
            found = w.position.get(batch[0])
            if found is None:
                w.cursor = -1
                return []
            w.cursor = found
        stride = nworkers * size
        start = w.cursor
        w.cursor += stride
        window: list[int] = []
        nxt = start + stride
        while len(window) < self.prefetch_depth and nxt < len(order):
            window.extend(order[nxt : nxt + size])
            nxt += stride
        return window[: self.prefetch_depth]


def make_loader(
    dataset: CacheFSDataset,
    *,
    batch_size: int = 32,
    shuffle: bool = False,
    sampler: Sampler[int] | None = None,
    generator: torch.Generator | None = None,
    **kwargs: Any,
) -> torch.utils.data.DataLoader[Any]:
    """A DataLoader whose sampler (``sampler``, or random/sequential) feeds the prefetch."""
    wrapped = PrefetchSampler(dataset, sampler, shuffle=shuffle, generator=generator)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=wrapped, **kwargs)


__all__ = [
    "CacheFSDataset",
    "OrderBoard",
    "PrefetchSampler",
    "PrefetchStats",
    "Prefetcher",
    "make_loader",
]
