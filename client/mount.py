"""``cachefs mount`` and ``cachefs umount``.

Mounting checks everything it can before touching the kernel (mount point
exists and is not already a mount, ``/dev/fuse`` exists, the metanodes answer,
the secret is accepted, the volume exists) and says which one failed.
``-d/--background`` forks; the parent returns only once the child's mount
answers a ``stat`` (like ``juicefs mount -d``), or exits non-zero with the
child's error.

The mount options start from ``pyfuse3.default_options`` (which has
``default_permissions``: the kernel checks modes with the real uid/gid) and
add ``fsname=``/``subtype=``. ``--allow-other`` lets users other than the one
who mounted in (safe only together with ``default_permissions``, which stays
on); without it the kernel refuses everyone else, root included.
``--mount-flags`` passes the kernel mount flags libfuse accepts (noexec,
noatime, ...; nosuid and nodev are FUSE's default). After mounting, the
mount's backing-device read-ahead (``read_ahead_kb``) is raised to 1 MiB:
the kernel's 128 KiB default costs about 1.7x on large sequential reads. The connection's
``max_background`` (and ``congestion_threshold``, three quarters of it) is
raised through fusectl from the kernel's 12 (9): asynchronous and direct I/O
(libaio, O_DIRECT, readahead) are background requests, and 12 in flight
starve a client with deep queues whose every request waits on the network.

Unmounting: the daemon writes its pid under ``/run/cachefs``, and beside it
a record of its session, with which a mount started there after this one
crashed ends that session at once (:mod:`.predecessor`); ``cachefs
umount`` sends it SIGTERM, on which it commits every dirty file, then ends the
FUSE loop and unmounts. Without a live daemon it falls back to ``fusermount3 -u``.
Committing has ``--unmount-timeout`` seconds (60); whatever is not committed
by then, or failed to commit, is written to a spill file under
``--spill-dir`` named in the log (:mod:`.spill`), and the unmount goes on
(exit status 1). ``cachefs umount --timeout`` (120) waits longer than that.

SIGUSR1 logs every task of the mount and the line it waits at
(:mod:`cachefs.taskdump`): what a hung request is waiting for. SIGUSR2
starts tracemalloc, and each later SIGUSR2 logs the allocation sites that
grew since the one before (:class:`cachefs.heap.MemoryTracer`): what holds
the memory. Free heap pages go back to the kernel as the mount runs
(:class:`cachefs.heap.HeapTrimmer`); docs/deploy.md says what a mount's
memory is made of.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pyfuse3
import trio

from cachefs import heap, logs, sdnotify
from cachefs.config import (
    ADDRS,
    LOG_LEVELS,
    SIZE,
    load_secret,
    load_tls,
    log_format_option,
    metrics_options,
    setup_logging,
    tls_options,
)
from cachefs.errors import (
    AuthFailed,
    CacheFSError,
    NotFound,
    PermissionDenied,
    TimedOut,
    Unavailable,
    Unreachable,
)
from cachefs.metrics import MetricsAddr, start_metrics
from cachefs.opstats import OpStats
from cachefs.rpc import RpcPool
from cachefs.taskdump import task_tree
from cachefs.transport import MODES, RdmaUnavailable

from . import (
    dircache_hook,
    fallocate_hook,
    libfuse_ops,
    lseek_hook,
    noflush_hook,
    predecessor,
    symlink_cache_hook,
)
from .dirahead import PER_MISS
from .fs import CacheFS
from .memory import MemoryBudget, upload_factor
from .session import Session
from .spill import DEFAULT_SPILL_DIR
from .volume import FUSE_WORKERS, MAX_BACKGROUND, ClientOptions, Volume

log = logging.getLogger(__name__)

RUN_DIR = Path(os.environ.get("CACHEFS_RUN_DIR", "/run/cachefs"))
READ_AHEAD_KB = 1024
FUSECTL = Path("/sys/fs/fuse/connections")
CONNECT_TIMEOUT = 10.0
CLOSE_TIMEOUT = 5.0  # closing the session at unmount


class MountError(click.ClickException):
    """A mount that cannot happen, with the reason in words."""


def pid_file(mountpoint: str | os.PathLike[str]) -> Path:
    real = os.path.realpath(mountpoint)
    return RUN_DIR / f"{hashlib.sha1(real.encode()).hexdigest()[:16]}.pid"


def session_record(mountpoint: str | os.PathLike[str]) -> Path:
    """Beside the pid file: the mount's session record (:mod:`.predecessor`)."""
    return pid_file(mountpoint).with_suffix(".session.json")


def mount_entry(mountpoint: str) -> tuple[str, str] | None:
    """``(major:minor, fstype)`` of the mount at ``mountpoint``, from mountinfo."""
    real = os.path.realpath(mountpoint)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        fields = line.split()
        if len(fields) < 7 or "-" not in fields:
            continue
        point = fields[4].encode().decode("unicode_escape")
        if point == real:
            sep = fields.index("-")
            found = (fields[2], fields[sep + 1])  # the last one wins (stacked mounts)
    return found


def check_mountpoint(mountpoint: str) -> None:
    """Raises MountError if the mount cannot happen here."""
    path = Path(mountpoint)
    if not path.exists():
        raise MountError(f"mount point {mountpoint} does not exist")
    if not path.is_dir():
        raise MountError(f"mount point {mountpoint} is not a directory")
    if os.path.ismount(path) or mount_entry(mountpoint) is not None:
        raise MountError(f"mount point {mountpoint} is busy: something is already mounted there")
    if not os.path.exists("/dev/fuse"):
        raise MountError(
            "/dev/fuse is missing: load the fuse kernel module (modprobe fuse) or run with --device /dev/fuse"
        )


def raise_read_ahead(mountpoint: str, kb: int = READ_AHEAD_KB) -> None:
    entry = mount_entry(mountpoint)
    if entry is None:
        return
    knob = Path("/sys/class/bdi") / entry[0] / "read_ahead_kb"
    try:
        knob.write_text(f"{kb}\n")
    except OSError as exc:
        log.warning(
            "could not raise read-ahead of %s to %d KiB (%s): %s",
            mountpoint,
            kb,
            knob,
            exc.strerror,
        )


def _fusectl_mounted() -> bool:
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(line.split()[2:3] == ["fusectl"] for line in mounts)


def raise_max_background(mountpoint: str, limit: int = MAX_BACKGROUND) -> None:
    """Let ``limit`` background requests of this mount's FUSE connection be in flight.

    pyfuse3 gives no way to set ``max_background`` in the INIT reply, so it is
    set afterwards in fusectl (``/sys/fs/fuse/connections/N``, N being the
    minor device number of the mount), which is mounted first if it is not.
    Needs root; otherwise (or in a container with a read-only /sys) one log
    line and the kernel's default stays.
    """
    if limit <= 0:
        return
    try:
        conn = FUSECTL / str(os.minor(os.stat(mountpoint).st_dev))
        if not conn.is_dir() and not _fusectl_mounted():
            proc = subprocess.run(
                ["mount", "-t", "fusectl", "none", str(FUSECTL)],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            if proc.returncode != 0:
                raise OSError(errno.EPERM, f"mount -t fusectl: {proc.stderr.strip()}")
        (conn / "max_background").write_text(f"{limit}\n")
        (conn / "congestion_threshold").write_text(f"{max(1, limit * 3 // 4)}\n")
    except (OSError, subprocess.SubprocessError) as exc:
        log.info(
            "kept the kernel's max_background for %s (could not raise it to %d: %s)",
            mountpoint, limit, exc,
        )  # fmt: skip
        return
    log.debug("max_background of %s raised to %d", mountpoint, limit)


# The kernel mount flags libfuse's mount accepts (3.14; it refuses relatime,
# nodiratime, strictatime, lazytime, ...). FUSE mounts are nosuid, nodev and
# relatime unless told otherwise.
KERNEL_FLAGS = ("atime", "noatime", "suid", "nosuid", "dev", "nodev", "exec", "noexec",
                "sync", "async", "dirsync")


def fuse_options(volume: str, read_only: bool, allow_other: bool = False,
                 flags: tuple[str, ...] = ()) -> set[str]:
    opts = set(pyfuse3.default_options) | set(flags)
    opts |= {f"fsname=cachefs:{volume}", "subtype=cachefs"}
    assert "default_permissions" in opts  # allow_other is only safe with it
    if allow_other:
        opts.add("allow_other")
    if read_only:
        opts.add("ro")
    return opts


class MountFlags(click.ParamType):
    """``noexec,noatime``: a comma-separated list of :data:`KERNEL_FLAGS`."""

    name = "flag,..."

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        if isinstance(value, tuple | list):
            value = ",".join(value)
        flags = tuple(f.strip() for f in str(value).split(",") if f.strip())
        for flag in flags:
            if flag not in KERNEL_FLAGS:
                self.fail(f"{flag!r} is not a kernel mount flag FUSE accepts "
                          f"(one of {', '.join(KERNEL_FLAGS)})", param, ctx)
        return flags


def describe(exc: CacheFSError, meta_addrs: list[str], volume: str) -> str:
    """The user-facing reason a mount failed."""
    if isinstance(exc, RdmaUnavailable):
        return f"--transport rdma: {exc.message} (use --transport auto to fall back to TCP)"
    if isinstance(exc, AuthFailed):
        return f"the metanodes refused the cluster secret ({exc.message}); check --secret-file"
    if isinstance(exc, PermissionDenied):
        return f"{exc.message}; give the volume's token with --token-file"
    if isinstance(exc, NotFound):
        return f"volume {volume!r} does not exist ({exc.message}); create it with 'cachefs volume create'"
    if isinstance(exc, Unavailable | Unreachable | TimedOut):
        return f"cannot reach the metanodes at {','.join(meta_addrs)}: {exc.message}"
    return f"mount failed: {exc}"


class MountCollector:
    """Prometheus view of one mount: L1, read path, block chain, write path.

    Read from the metrics thread while the FUSE loop runs; the counters are
    plain ints, so a scrape sees each one whole (no lock needed).
    """

    def __init__(self, engine: Volume, ops: OpStats, calls: OpStats | None = None) -> None:
        self.engine = engine
        self.ops = ops
        self.calls = calls  # the RPC pool's round trips by method
        self.memory: MemoryBudget | None = None  # the mount's bound, once it is set up
        self.pushes: dict[str, int] | None = None  # the FUSE front's page pushes (pagepush.py), if on
        self._registry: Any = None  # a CollectorRegistry of this collector alone, made on first use

    def text(self) -> bytes:
        """This collector alone in the Prometheus text format: ``.cachefs/stats``
        (the same numbers as /metrics, without the process-wide series)."""
        from prometheus_client import CollectorRegistry, generate_latest

        if self._registry is None:
            self._registry = CollectorRegistry(auto_describe=False)
            self._registry.register(self)
        return generate_latest(self._registry)

    def _ops(self):  # type: ignore[no-untyped-def]
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        latency = HistogramMetricFamily("cachefs_mount_op_latency_seconds",
                                        "FUSE request latency by op, errors included", labels=["op"])
        for op in sorted(self.ops.counts):
            buckets, total = self.ops.histogram(op)
            latency.add_metric([op], buckets, total)
        yield latency
        errors = CounterMetricFamily("cachefs_mount_op_errors", "FUSE requests answered with an error, by errno",
                                     labels=["op", "errno"])
        for (op, code), count in sorted(self.ops.errors.items()):
            errors.add_metric([op, errno.errorcode.get(code, str(code))], count)
        yield errors
        if self.calls is not None:
            rpc = HistogramMetricFamily("cachefs_mount_rpc_latency_seconds",
                                        "Round trip of the RPCs this mount made, by method (errors included)",
                                        labels=["method"])
            for method in sorted(self.calls.counts):
                buckets, total = self.calls.histogram(method)
                rpc.add_metric([method], buckets, total)
            yield rpc

    def _memory(self, budget: MemoryBudget):  # type: ignore[no-untyped-def]
        from prometheus_client.core import GaugeMetricFamily

        engine = self.engine
        leases = engine.session.leases
        parts = budget.parts(
            inodes=len(engine.inodes), ghosts=engine.inodes.ghosts, leases=len(leases) if leases is not None else 0,
            l2_blocks=len(engine.l2.store) if engine.l2 is not None else 0,
        )
        each = GaugeMetricFamily("cachefs_mount_memory_budget_bytes",
                                 "The parts of the mount's memory bound (docs/deploy.md, Memory of a mount)",
                                 labels=["part"])
        for part, size in parts.items():
            each.add_metric([part], size)
        yield each
        yield _gauge("cachefs_mount_memory_bound_bytes",
                     "The most resident memory the mount may hold: the sum of its budgets", sum(parts.values()))

    def collect(self):  # type: ignore[no-untyped-def]
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        engine = self.engine
        yield _gauge("cachefs_mount_l1_used_bytes", "Bytes in the L1 block cache", engine.l1.used)
        yield _gauge("cachefs_mount_l1_capacity_bytes", "Capacity of the L1 block cache", engine.l1.capacity)
        l1c = CounterMetricFamily("cachefs_mount_l1_events", "L1 cache events", labels=["event"])
        for name in ("hits", "misses", "evictions"):
            l1c.add_metric([name], getattr(engine.l1.stats, name))
        yield l1c
        reads = engine.reader.stats
        yield _counter("cachefs_mount_read_bytes", "Bytes read by applications", reads["bytes"])
        yield _counter("cachefs_mount_read_l1_hit_bytes", "Bytes read served from L1", reads["l1_hit_bytes"])
        yield _counter("cachefs_mount_slice_lists", "Chunk slice lists asked of the metanodes",
                       reads["slice_lists"])
        yield _counter("cachefs_mount_early_reads", "Opens that started fetching a file's start "
                       "ahead of its first read (none when L1 holds it)", reads["early_reads"])
        fetches = CounterMetricFamily("cachefs_mount_read_fetches", "Fetches the read path issued, by kind",
                                      labels=["kind"])
        for kind in ("range", "block"):
            fetches.add_metric([kind], reads[f"{kind}_fetches"])
        fetches.add_metric(["prefetch"], reads["prefetches"])
        yield fetches
        yield _counter("cachefs_mount_batch_fetches", "get_many batches the read path sent (prefetches of "
                       "many blocks from one cache node, reader.prefetch_many)", reads["batch_fetches"])
        yield _counter("cachefs_mount_batch_blocks", "Blocks those batches brought", reads["batch_blocks"])
        if engine.reader.dirahead is not None:
            ahead = engine.reader.dirahead.stats
            yield _counter("cachefs_mount_dir_readahead_blocks", "Blocks of a directory's next imported "
                           "files fetched ahead by opens that missed (dirahead.py)", ahead["dir_prefetches"])
            yield _counter("cachefs_mount_dir_readahead_used_blocks", "Of those, blocks a read then used",
                           ahead["dir_prefetches_used"])
            yield _counter("cachefs_mount_dir_readahead_wasted_blocks", "Of those, blocks evicted from L1 "
                           "unread (each time some are found, the window halves)", ahead["dir_prefetches_wasted"])
        if self.pushes is not None:
            pushed = self.pushes
            yield _counter("cachefs_mount_page_pushes", "Files fetched ahead pushed into the kernel's page "
                           "cache as they arrived (pagepush.py)", pushed["page_pushes"])
            yield _counter("cachefs_mount_page_push_bytes", "Bytes those pushes stored", pushed["page_push_bytes"])
            yield _counter("cachefs_mount_page_push_failures", "Pushes the kernel refused (it forgot the "
                           "inode meanwhile)", pushed["page_push_failures"])
        yield _counter("cachefs_mount_readahead_used_blocks",
                       "Prefetched blocks a read then used, found in L1 or joined in flight (readahead "
                       "efficiency: over "
                       "cachefs_mount_read_fetches{kind=\"prefetch\"})", reads["prefetches_used"])
        writes = engine.write_stats
        yield _counter("cachefs_mount_write_bytes", "Bytes written by applications", writes.written)
        yield _counter("cachefs_mount_committed_bytes", "Bytes committed to the metanodes as slices",
                       writes.bytes)
        yield _counter("cachefs_mount_slices_committed", "Slices committed", writes.slices)
        yield _counter("cachefs_mount_stored_blocks", "Blocks stored on backing storage", writes.blocks)
        commit = HistogramMetricFamily("cachefs_mount_commit_latency_seconds",
                                       "Latency of one slice commit (write_slice) at the metanodes")
        if "commit" in writes.commits.counts:
            buckets, total = writes.commits.histogram("commit")
            commit.add_metric([], buckets, total)
        yield commit
        if engine.l2 is not None:
            l2 = engine.l2.stats
            yield _gauge("cachefs_mount_l2_used_bytes", "Bytes in the L2 flash cache", engine.l2.store.used)
            yield _gauge("cachefs_mount_l2_capacity_bytes", "Capacity of the L2 flash cache", engine.l2.store.capacity)
            yield _counter("cachefs_mount_l2_hit_bytes", "Bytes read served from L2", l2["l2_hit_bytes"])
            l2c = CounterMetricFamily("cachefs_mount_l2_events", "L2 cache events", labels=["event"])
            for name, value in l2.items():
                if name != "l2_hit_bytes":
                    l2c.add_metric([name.removeprefix("l2_")], value)
            yield l2c
        chain = CounterMetricFamily("cachefs_mount_blocks", "Block fetches by source", labels=["what"])
        for name, value in engine.session.stats.items():
            chain.add_metric([name], value)
        yield chain
        yield from self._ops()
        dirty = GaugeMetricFamily("cachefs_mount_dirty_bytes", "Bytes written and not yet committed")
        dirty.add_metric([], engine.dirty_bytes())
        yield dirty
        inodes = GaugeMetricFamily("cachefs_mount_inodes", "Inodes the kernel knows or has open")
        inodes.add_metric([], len(engine.inodes))
        yield inodes
        leases = engine.session.leases
        if leases is not None:
            held = GaugeMetricFamily("cachefs_mount_leases_held", "Metadata leases this mount holds")
            held.add_metric([], len(leases))
            yield held
            events = CounterMetricFamily(
                "cachefs_mount_lease_events",
                "Metadata lease events (hits: answered from memory, no metanode request)",
                labels=["event"],
            )
            for name, value in leases.stats.items():
                events.add_metric([name], value)
            yield events
        rss = GaugeMetricFamily(
            "cachefs_mount_rss_bytes",
            "Resident memory of the mount process (L1, write buffers, inodes, fixed overhead)",
        )
        rss.add_metric([], heap.rss())
        yield rss
        if self.memory is not None:
            yield from self._memory(self.memory)
        failed = CounterMetricFamily(
            "cachefs_mount_task_failures",
            "Background tasks that raised an unexpected exception (logged; the mount kept serving)",
            labels=["task"],
        )
        for task, count in sorted(engine.nursery.failures.items()):
            failed.add_metric([task], count)
        yield failed


def _gauge(name: str, help_text: str, value: float):  # type: ignore[no-untyped-def]
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, help_text, value=value)


def _counter(name: str, help_text: str, value: float):  # type: ignore[no-untyped-def]
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name, help_text, value=value)


async def serve(
    meta_addrs: list[str],
    volume: str,
    mountpoint: str,
    options: ClientOptions,
    *,
    secret: bytes | None,
    zone: str,
    ready: Callable[[str | None], None],
    metrics: MetricsAddr | None = None,
    tls: ssl.SSLContext | None = None,
    token: str | None = None,
    allow_other: bool = False,
    mount_flags: tuple[str, ...] = (),
    connect_timeout: float = CONNECT_TIMEOUT,
) -> int:
    """Run one mount until it is unmounted or signalled; returns an exit status."""
    async with RpcPool(secret=secret, tls=tls) as pool:
        try:
            with trio.fail_after(connect_timeout):
                session = await Session.connect(
                    pool, meta_addrs, volume, zone=zone, transport=options.transport, token=token
                )
        except trio.TooSlowError:
            ready(
                f"cannot reach the metanodes at {','.join(meta_addrs)} within {connect_timeout:g}s"
            )
            return 1
        except CacheFSError as exc:
            ready(describe(exc, meta_addrs, volume))
            return 1
        return await run_fs(session, mountpoint, options, ready, metrics,
                            allow_other=allow_other, mount_flags=mount_flags)


def _take_over(session: Session, record_at: Path, nursery: trio.Nursery) -> None:
    """Take the mount point over from a mount that crashed there: end its
    session in the background (:mod:`.predecessor`), and leave our record."""
    old = predecessor.read(record_at)
    if old is not None and old.session != session.session_id and predecessor.crashed(old):
        nursery.start_soon(_end_session, session, old)
    predecessor.write(record_at, predecessor.Record.of_this_process(session.session_id, session.volume))


async def _end_session(session: Session, old: predecessor.Record) -> None:
    try:
        await session.meta.close_session(old.session)
    except CacheFSError as exc:  # already expired, or another identity's
        log.info("session %s of the mount that crashed here is not ended: %s", old.session, exc)
    else:
        log.info("ended session %s of the mount that crashed here (pid %d)", old.session, old.pid)


async def run_fs(
    session: Session,
    mountpoint: str,
    options: ClientOptions,
    ready: Callable[[str | None], None],
    metrics: MetricsAddr | None = None,
    *,
    allow_other: bool = False,
    mount_flags: tuple[str, ...] = (),
) -> int:
    """Mount ``session``'s volume at ``mountpoint`` and serve until unmounted."""
    async with trio.open_nursery() as nursery:
        try:
            engine = Volume(session, options, nursery=nursery)
        except CacheFSError as exc:
            ready(f"--cache-dir: {exc.message}")
            nursery.cancel_scope.cancel()
            await session.close()
            return 1
        fuse_opts = fuse_options(session.volume, options.read_only, allow_other, mount_flags)
        front = CacheFS(engine)
        record_at = session_record(mountpoint)  # before the mount: realpath stats it
        try:
            pyfuse3.init(front, mountpoint, fuse_opts)
        except RuntimeError as exc:
            ready(f"could not mount at {mountpoint}: {exc}")
            nursery.cancel_scope.cancel()
            await session.close()
            return 1
        stopping = _Stopping(options.unmount_timeout)
        try:  # from here on, whatever fails unmounts (else a stat of the mount point waits forever)
            _hook_libfuse(front, engine)  # before any request
            _take_over(session, record_at, nursery)
            collector = MountCollector(engine, front.op_stats, session.meta.pool.time_calls())
            collector.pushes = front.pages.stats if front.pages is not None else None
            front.control.render_stats = collector.text
            if metrics is not None:
                from prometheus_client import REGISTRY

                REGISTRY.register(collector)
                try:
                    start_metrics(metrics)
                except OSError as exc:  # a --metrics-addr that is taken
                    ready(str(exc))
                    return 1
            engine.nursery.start_soon(_announce, nursery, mountpoint, ready, options.max_background,
                                      session.meta.addrs)
            engine.nursery.start_soon(_on_signals, engine, stopping, restart=True)
            engine.nursery.start_soon(_trim_heap, restart=True)
            collector.memory = memory_budget(engine, heap.rss())  # set up, not yet serving
            await pyfuse3.main(max_tasks=options.fuse_workers)
        finally:
            with trio.CancelScope(shield=True):
                await engine.flush_all(stopping.deadline())
            nursery.cancel_scope.cancel()  # uploads still running: their data was spilled
            pyfuse3.close(unmount=True)
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                await session.close()  # else the metanodes expire the session
            predecessor.remove(record_at, session.session_id)
    log.info("unmounted %s", mountpoint)
    if engine.spilled:
        log.error("unmounted with %d file(s) not committed; their data is in spill files (see above)", engine.spilled)
        return 1
    return 0


def memory_budget(engine: Volume, fixed: int) -> MemoryBudget:
    """The mount's memory bound (:mod:`.memory`); ``fixed``: its resident size
    once it is set up, before it serves."""
    options, session = engine.options, engine.session
    policy = None
    with contextlib.suppress(CacheFSError):  # no placement groups yet: the widest layout
        policy = session.view.policy(session.volume) if session.view is not None else None
    return MemoryBudget(
        fixed=fixed, l1=options.l1_bytes, write_buffers=options.write_buffer_total, block_size=engine.block_size,
        upload_parallel=options.upload_parallel, upload_factor=upload_factor(policy),
        fuse_workers=options.fuse_workers, l2=engine.l2 is not None,
    )


class _Stopping:
    """When the unmount's commit time ends: ``unmount_timeout`` seconds after
    the first signal (or after the FUSE loop ended, unmounted from outside)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._deadline: float | None = None

    def deadline(self) -> float:
        if self._deadline is None:
            self._deadline = trio.current_time() + self.timeout
        return self._deadline


def _hook_libfuse(front: CacheFS, engine: Volume) -> None:
    """What pyfuse3 cannot answer itself: fallocate(2), SEEK_DATA and
    SEEK_HOLE, read-only opens with FOPEN_NOFLUSH (their close sends no FLUSH),
    symlink targets kept by the kernel (FUSE_CACHE_SYMLINKS), and listings of
    leased directories kept by the kernel (FOPEN_CACHE_DIR)."""
    try:
        ops = libfuse_ops.session_table(pyfuse3.__file__)
    except libfuse_ops.HookUnavailable as exc:
        log.warning("fallocate stays unsupported (EOPNOTSUPP), lseek sees no holes, "
                    "read-only closes flushed, symlink targets and listings uncached: %s", exc)
        return
    fallocate_hook.install(front.fallocate, engine.nursery, ops)
    lseek_hook.install(front.lseek, engine.nursery, ops)
    noflush_hook.install(ops)
    symlink_cache_hook.install(ops)
    dircache_hook.install(front.dir_cacheable, ops)


async def _announce(
    nursery: trio.Nursery,
    mountpoint: str,
    ready: Callable[[str | None], None],
    max_background: int = MAX_BACKGROUND,
    meta_addrs: list[str] | None = None,
) -> None:
    """Ready means: the kernel routes a stat of the mount point to us."""
    try:
        await trio.to_thread.run_sync(os.stat, mountpoint)
    except OSError as exc:
        ready(f"the mount at {mountpoint} does not answer: {exc}")
        pyfuse3.terminate()
        return
    # Both resolve the mount point (realpath lstats it), which is a FUSE
    # request: from this thread, with attr_timeout 0, it would wait on itself.
    await trio.to_thread.run_sync(raise_read_ahead, mountpoint)
    await trio.to_thread.run_sync(raise_max_background, mountpoint, max_background)
    await trio.to_thread.run_sync(_write_pid, mountpoint, meta_addrs or [])
    log.info("mounted at %s", mountpoint)
    ready(None)
    sdnotify.serving(nursery, f"mounted at {mountpoint}")


async def _on_signals(engine: Volume, stopping: _Stopping) -> None:
    """SIGTERM and SIGINT unmount (after committing); SIGHUP reloads the log
    level and reopens the log file (cachefs/logs.py); SIGUSR1 logs the tasks,
    SIGUSR2 what grew on the heap (cachefs/heap.py)."""
    stop = (signal.SIGTERM, signal.SIGINT)
    tracer = heap.MemoryTracer()
    with trio.open_signal_receiver(*stop, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2) as signals:
        async for signum in signals:
            if signum == signal.SIGUSR1:
                log.info("tasks of this mount (SIGUSR1):\n%s", task_tree())
                continue
            if signum == signal.SIGHUP:
                logs.reload()
                continue
            if signum == signal.SIGUSR2:
                log.info("memory of this mount (SIGUSR2), resident %d MiB: %s", heap.rss() >> 20, tracer.step())
                continue
            log.info("signal %d: committing dirty data and unmounting", signum)
            await engine.flush_all(stopping.deadline())
            pyfuse3.terminate()
            return


async def _trim_heap() -> None:
    """Give freed heap pages back when due (looked at every ``TRIM_CHECK``
    seconds, here); the trim in a thread, since one of a few hundred MiB of
    heap takes 10-40 ms."""
    trimmer = heap.HeapTrimmer()
    if not trimmer.available:
        log.info("no malloc_trim in this libc: freed heap pages stay resident")
        return
    while True:
        await trio.sleep(heap.TRIM_CHECK)
        if trimmer.due():
            await trio.to_thread.run_sync(trimmer.trim)


def _write_pid(mountpoint: str, meta_addrs: list[str]) -> None:
    """``pid``, the mount point and the metanode addresses, a line each
    (``cachefs umount`` reads the first two, ``cachefs info`` the third)."""
    try:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        pid_file(mountpoint).write_text(f"{os.getpid()}\n{os.path.realpath(mountpoint)}\n{','.join(meta_addrs)}\n")
    except OSError as exc:
        log.warning("could not write pid file under %s: %s", RUN_DIR, exc)


def _remove_pid(mountpoint: str) -> None:
    with contextlib.suppress(OSError):
        path = pid_file(mountpoint)
        if path.read_text().split()[0] == str(os.getpid()):
            path.unlink()


@click.command("mount")
@click.argument("meta_addrs", type=ADDRS)
@click.argument("volume")
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("-d", "--background", is_flag=True, help="Daemonize; return once the mount is ready.")
@click.option(
    "--l1-size", type=SIZE, default="512M", show_default=True, help="L1 memory block cache size."
)
@click.option(
    "--readahead", type=SIZE, default="32M", show_default=True, help="Largest readahead window."
)
@click.option(
    "--dir-readahead", type=click.IntRange(0, 1024), default=PER_MISS, show_default=True,
    help="Small files of a directory fetched ahead into L1 by each open that misses, in listing "
    "order (the window; 0: off).",
)
@click.option(
    "--push-pages/--no-push-pages", default=True, show_default=True,
    help="Push the small files fetched ahead into the kernel's page cache as they arrive (or at "
    "their open), so that their reads need no request to the mount (kept only while the file is "
    "unchanged).",
)
@click.option(
    "--write-buffer", type=SIZE, default="64M", show_default=True, help="Write buffer per file."
)
@click.option(
    "--write-buffer-total", type=SIZE, default="256M", show_default=True,
    help="Write buffers of all files together (uncommitted bytes in memory).",
)
@click.option(
    "--attr-timeout",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Kernel attribute cache, seconds.",
)
@click.option(
    "--entry-timeout",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Kernel name cache, seconds.",
)
@click.option(
    "--write-through/--no-write-through",
    default=False,
    show_default=True,
    help="Also put written blocks into the cache tier.",
)
@click.option(
    "--transport",
    type=click.Choice(MODES),
    default="tcp",
    show_default=True,
    help="Block transport to cache nodes.",
)
@click.option(
    "--max-background",
    type=click.IntRange(0, 65535),
    default=MAX_BACKGROUND,
    show_default=True,
    help="FUSE requests in flight in the background (async/direct I/O); 0: the kernel's 12.",
)
@click.option(
    "--fuse-workers",
    type=click.IntRange(1, 1024),
    default=FUSE_WORKERS,
    show_default=True,
    help="FUSE requests served at once (pyfuse3 worker tasks, each with a 1 MiB receive buffer).",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Directory on local flash for the L2 block cache (default: no L2).",
)
@click.option(
    "--cache-size", type=SIZE, default="10G", show_default=True, help="L2 capacity in bytes."
)
@click.option(
    "--free-space-ratio",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.1,
    show_default=True,
    help="Share of the L2 directory's filesystem that L2 keeps free.",
)
@click.option(
    "--unmount-timeout",
    type=click.FloatRange(0),
    default=60.0,
    show_default=True,
    help="Seconds to commit dirty files at unmount; then what is left goes to spill files.",
)
@click.option(
    "--spill-dir",
    type=click.Path(file_okay=False),
    default=DEFAULT_SPILL_DIR,
    show_default=True,
    help="Where data that could not be committed at unmount is kept.",
)
@click.option(
    "--connect-timeout",
    type=click.FloatRange(0, min_open=True),
    default=CONNECT_TIMEOUT,
    show_default=True,
    help="Seconds to keep trying the metanodes when mounting (they may still be starting) before "
    "giving up.",
)
@click.option("--zone", default="", help="Zone of this node (its cache ring is tried first).")
@click.option("--read-only", is_flag=True, help="Mount read-only.")
@click.option(
    "--allow-other",
    is_flag=True,
    help="Let users other than the one mounting use the mount (the kernel still checks "
    "modes: default_permissions). Needs root or user_allow_other in /etc/fuse.conf.",
)
@click.option(
    "--mount-flags",
    type=MountFlags(),
    default="",
    help="Kernel mount flags, comma separated: noexec, noatime, sync, dirsync, suid, dev, ... "
    "(FUSE's default: nosuid,nodev).",
)
@click.option(
    "--secret-file",
    envvar="CACHEFS_SECRET_FILE",
    type=click.Path(dir_okay=False),
    help="A client credential for the volume (cachefs credential issue) or the cluster secret (or set CACHEFS_SECRET).",
)
@click.option(
    "--insecure", is_flag=True, envvar="CACHEFS_INSECURE", help="Talk to an insecure (lab) cluster."
)
@click.option("--log-level", type=LOG_LEVELS, default="INFO", show_default=True,
              help="Log level (SIGHUP reads it again from the --config file).")
@log_format_option
@metrics_options("mount", envvar=None)
@click.option(
    "--log-file",
    type=click.Path(dir_okay=False),
    help="Log here (default with -d: /var/log/cachefs/mount-VOLUME.log).",
)
@click.option(
    "--token-file",
    envvar="CACHEFS_TOKEN_FILE",
    type=click.Path(exists=True, dir_okay=False),
    help="File holding the volume's mount token (not needed for an open volume).",
)
@tls_options
def mount_command(
    meta_addrs: list[str],
    volume: str,
    mountpoint: str,
    background: bool,
    l1_size: int,
    readahead: int,
    dir_readahead: int,
    push_pages: bool,
    write_buffer: int,
    write_buffer_total: int,
    attr_timeout: float,
    entry_timeout: float,
    write_through: bool,
    transport: str,
    max_background: int,
    fuse_workers: int,
    cache_dir: str | None,
    cache_size: int,
    free_space_ratio: float,
    unmount_timeout: float,
    spill_dir: str,
    connect_timeout: float,
    zone: str,
    read_only: bool,
    allow_other: bool,
    mount_flags: tuple[str, ...],
    secret_file: str | None,
    insecure: bool,
    log_level: str,
    log_format: str,
    log_file: str | None,
    metrics_addr: MetricsAddr,
    no_metrics: bool,
    token_file: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
) -> None:
    """Mount VOLUME of the cluster whose metanodes are META_ADDRS at MOUNTPOINT."""
    token = Path(token_file).read_text().strip() or None if token_file else None
    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(tls_cert, tls_key, tls_ca)
    mountpoint = os.path.abspath(mountpoint)
    check_mountpoint(mountpoint)
    options = ClientOptions(
        l1_bytes=l1_size,
        readahead_max=readahead,
        dir_readahead=dir_readahead,
        push_pages=push_pages,
        write_buffer=write_buffer,
        write_buffer_total=write_buffer_total,
        attr_timeout=attr_timeout,
        entry_timeout=entry_timeout,
        write_through=write_through,
        transport=transport,
        read_only=read_only,
        max_background=max_background,
        fuse_workers=fuse_workers,
        cache_dir=os.path.abspath(cache_dir) if cache_dir else "",
        cache_size=cache_size,
        free_space_ratio=free_space_ratio,
        unmount_timeout=unmount_timeout,
        spill_dir=os.path.abspath(spill_dir),
    )

    def run(ready: Callable[[str | None], None]) -> int:
        try:
            main = functools.partial(
                serve, meta_addrs, volume, mountpoint, options, secret=secret, zone=zone, ready=ready,
                metrics=None if no_metrics else metrics_addr, tls=tls, token=token, allow_other=allow_other,
                mount_flags=mount_flags, connect_timeout=connect_timeout,
            )
            return trio.run(main)
        finally:
            _remove_pid(mountpoint)

    if not background:
        setup_logging("mount", log_level, log_format, log_file)

        def say(error: str | None) -> None:
            if error is not None:
                click.echo(f"Error: {error}", err=True)

        sys.exit(run(say))
    _daemonize(run, volume, log_level, log_format, log_file)


def _daemonize(
    run: Callable[[Callable[[str | None], None]], int],
    volume: str,
    level: str,
    log_format: str,
    log_file: str | None,
) -> None:
    """Fork; the parent waits for the child's verdict on a pipe."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        with os.fdopen(rfd, "rb") as pipe:
            verdict = pipe.read().decode(errors="replace")
        if verdict.startswith("ok"):
            click.echo(f"cachefs mounted (pid {pid})")
            return
        os.waitpid(pid, 0)
        raise MountError(
            verdict.removeprefix("error: ").strip()
            or "the mount process exited before the mount was ready"
        )
    # Child: detach from the terminal and session.
    os.close(rfd)
    os.setsid()
    if log_file is None:
        default = Path("/var/log/cachefs")
        with contextlib.suppress(OSError):
            default.mkdir(parents=True, exist_ok=True)
            log_file = str(default / f"mount-{volume}.log")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    if not log_file:
        os.dup2(null, 1)
        os.dup2(null, 2)
    setup_logging("mount", level, log_format, log_file, stderr_too=True)  # fds 1 and 2 to the log file
    told = False

    def ready(error: str | None) -> None:
        nonlocal told
        if told:
            return
        told = True
        os.write(wfd, b"ok" if error is None else f"error: {error}".encode())
        os.close(wfd)

    status = 1
    try:
        status = run(ready)
    except BaseException:
        log.exception("mount process failed")
        ready("the mount process failed; see its log")
    finally:
        if not told:
            ready("the mount process exited before the mount was ready")
        os._exit(status)


@click.command("umount")
@click.argument("mountpoint", type=click.Path())
@click.option(
    "--timeout",
    type=click.FloatRange(1),
    default=120.0,
    show_default=True,
    help="Seconds to wait for dirty data to be committed.",
)
def umount_command(mountpoint: str, timeout: float) -> None:
    """Unmount a cachefs mount, committing its dirty data first."""
    mountpoint = os.path.abspath(mountpoint)
    entry = mount_entry(mountpoint)
    if entry is None:
        raise click.ClickException(f"{mountpoint} is not mounted")
    if not entry[1].startswith("fuse"):
        raise click.ClickException(f"{mountpoint} is not a cachefs mount (it is {entry[1]})")
    pid = _daemon_pid(mountpoint)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if mount_entry(mountpoint) is None and not _alive(pid):
                return
            time.sleep(0.1)
        raise click.ClickException(
            f"the mount daemon (pid {pid}) did not finish within {timeout:.0f}s"
        )
    # No daemon we know of: unmount in the kernel (dirty data, if any, died with it).
    proc = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if proc.returncode != 0:
        raise click.ClickException(f"fusermount3 -u {mountpoint}: {proc.stderr.strip()}")


def _daemon_pid(mountpoint: str) -> int | None:
    try:
        pid_text, where, *_ = pid_file(mountpoint).read_text().split("\n")
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    if where != os.path.realpath(mountpoint) or not _alive(pid):
        return None
    return pid


def mount_meta_addrs(mountpoint: str) -> list[str]:
    """The metanode addresses the mount at ``mountpoint`` uses (from its pid file; [] if unknown)."""
    try:
        lines = pid_file(mountpoint).read_text().split("\n")
    except OSError:
        return []
    if len(lines) < 3 or lines[1] != os.path.realpath(mountpoint) or not lines[2]:
        return []
    return lines[2].split(",")


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie child of ours does not)."""
    return predecessor.process_started(pid) is not None
