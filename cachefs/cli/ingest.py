"""``cachefs import``: copy a local tree into a volume, N files in flight, resumable.

Like ``juicefs sync`` or ``rclone copy`` for getting a dataset in. The
destination is a directory under a cachefs mount, or, with ``--volume``, a
path inside a volume reached through the native client (no FUSE). Files,
directories and symbolic links keep their modes and modification times; hard
links are copied as separate files; owners are not copied.

Resuming is the same command again: a regular file already at the
destination with the source's size and modification time (to the
nanosecond) is skipped. The time is set only after the file's data is
committed, so a file cut off by an interruption, however it stopped, never
looks complete. Directory modes and times are set last, deepest first, since
copying into a directory changes its time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import click

from cachefs.config import ADDRS, load_secret, load_tls, setup_logging, tls_options

CHUNK = 4 << 20  # bytes per read/write of a large file
WHOLE = 16 << 20  # files up to this size go to the native client in one call


@dataclass(frozen=True)
class Entry:
    """One thing to copy: ``rel`` is its path under the source root ("" for the root)."""

    rel: str
    kind: str  # "file", "dir" or "link"
    mode: int  # permission bits (with setuid/setgid/sticky)
    size: int
    atime_ns: int
    mtime_ns: int
    target: str = ""  # a link's target


def shown(path: str) -> str:
    """A path for messages: names that are not UTF-8 show their bytes as escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def scan(src: str, errors: list[str]) -> list[Entry]:
    """Every directory, file and link under ``src``, parents before children.
    Sockets, FIFOs and devices are reported as errors and left out."""
    out: list[Entry] = []
    pending = [""]
    while pending:
        rel = pending.pop()
        here = os.path.join(src, rel) if rel else src
        try:
            with os.scandir(here) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            errors.append(f"{shown(here)}: {exc.strerror or exc}")
            continue
        dirs = []
        for child in children:
            crel = os.path.join(rel, child.name) if rel else child.name
            try:
                st = child.stat(follow_symlinks=False)
                target = os.readlink(child.path) if stat.S_ISLNK(st.st_mode) else ""
            except OSError as exc:
                errors.append(f"{shown(child.path)}: {exc.strerror or exc}")
                continue
            kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                    else "link" if stat.S_ISLNK(st.st_mode) else "")
            if not kind:
                errors.append(f"{shown(child.path)}: not a regular file, directory or symbolic link; skipped")
                continue
            out.append(Entry(crel, kind, stat.S_IMODE(st.st_mode), st.st_size if kind == "file" else 0,
                             st.st_atime_ns, st.st_mtime_ns, target))
            if kind == "dir":
                dirs.append(crel)
        pending.extend(reversed(dirs))
    return out


class Target(Protocol):
    """Where files go: a directory in a mount, or a path in a volume."""

    def describe(self, rel: str) -> str: ...

    def lstat(self, rel: str) -> os.stat_result | None: ...

    def listing(self, rel: str) -> dict[str, os.stat_result]: ...

    def mkdir(self, rel: str) -> None: ...

    def remove(self, rel: str, is_dir: bool) -> None: ...

    def copy(self, src: str, entry: Entry, existed: bool) -> None: ...

    def symlink(self, entry: Entry) -> None: ...

    def readlink(self, rel: str) -> str: ...

    def finish_dir(self, entry: Entry) -> None: ...

    def close(self) -> None: ...


class MountTarget:
    """A directory of a mounted filesystem (cachefs's, or any other): plain syscalls."""

    def __init__(self, root: str) -> None:
        self.root = root

    def describe(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def lstat(self, rel: str) -> os.stat_result | None:
        try:
            return os.lstat(self.describe(rel))
        except FileNotFoundError:
            return None

    def listing(self, rel: str) -> dict[str, os.stat_result]:
        # cachefs answers readdir with attributes (readdirplus): the stats come from the kernel's cache
        with os.scandir(self.describe(rel)) as it:
            return {e.name: e.stat(follow_symlinks=False) for e in it}

    def mkdir(self, rel: str) -> None:
        os.mkdir(self.describe(rel), 0o700)  # writable until finish_dir gives it its mode

    def remove(self, rel: str, is_dir: bool) -> None:
        path = self.describe(rel)
        if is_dir:
            import shutil

            shutil.rmtree(path)
        else:
            os.unlink(path)

    def copy(self, src: str, entry: Entry, existed: bool) -> None:
        path = self.describe(entry.rel)
        with open(src, "rb", buffering=0) as fin:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, entry.mode)  # the process umask is 0
            try:
                while True:
                    data = fin.read(CHUNK)
                    if not data:
                        break
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                if existed or entry.mode & 0o6000:  # an old file's mode, or setuid/setgid a write cleared
                    os.fchmod(fd, entry.mode)
            finally:
                os.close(fd)  # close() commits: only then is the time set
        os.utime(path, ns=(entry.atime_ns, entry.mtime_ns))

    def symlink(self, entry: Entry) -> None:
        path = self.describe(entry.rel)
        os.symlink(entry.target, path)
        with contextlib.suppress(NotImplementedError, OSError):
            os.utime(path, ns=(entry.atime_ns, entry.mtime_ns), follow_symlinks=False)

    def readlink(self, rel: str) -> str:
        return os.readlink(self.describe(rel))

    def finish_dir(self, entry: Entry) -> None:
        path = self.describe(entry.rel)
        os.chmod(path, entry.mode)
        os.utime(path, ns=(entry.atime_ns, entry.mtime_ns))

    def close(self) -> None:
        pass


class VolumeTarget:
    """A path inside a volume, through the native client (``cachefs.client.api``): no FUSE
    in between, and every file's create, write, commit and attributes in one loop call."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = "/" + root.strip("/")

    def describe(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def lstat(self, rel: str) -> os.stat_result | None:
        try:
            return self.fs.lstat(self.describe(rel))
        except FileNotFoundError:
            return None

    def listing(self, rel: str) -> dict[str, os.stat_result]:
        return {e.name: e.stat for e in self.fs.scandir(self.describe(rel))}  # one readdir, attributes included

    def mkdir(self, rel: str) -> None:
        self.fs.mkdir(self.describe(rel), 0o700)

    def remove(self, rel: str, is_dir: bool) -> None:
        if not is_dir:
            self.fs.remove(self.describe(rel))
            return
        for top, _, files in reversed(list(self.fs.walk(self.describe(rel)))):
            for name in files:
                self.fs.remove(f"{top.rstrip('/')}/{name}")
            self.fs.rmdir(top)

    async def _write(self, path: str, entry: Entry, data: bytes | None, fin: Any) -> None:
        import trio

        afs = self.fs.aio
        f = await afs.open(path, "wb")
        try:
            if data is not None:
                await f.write(data)
            else:
                while chunk := await trio.to_thread.run_sync(fin.read, CHUNK):
                    await f.write(chunk)
        finally:
            await f.close()
        await afs.engine.setattr(f.inode.ino, mode=entry.mode, atime_ns=entry.atime_ns, mtime_ns=entry.mtime_ns)
        afs.engine.inodes.drop_if_idle(f.inode)

    def copy(self, src: str, entry: Entry, existed: bool) -> None:
        with open(src, "rb") as fin:
            data = fin.read() if entry.size <= WHOLE else None
            self.fs.call(self._write, self.describe(entry.rel), entry, data, fin)

    def symlink(self, entry: Entry) -> None:
        path = self.describe(entry.rel)
        self.fs.symlink(entry.target, path)
        self.fs.utime(path, ns=(entry.atime_ns, entry.mtime_ns), follow_symlinks=False)

    def readlink(self, rel: str) -> str:
        return self.fs.readlink(self.describe(rel))

    async def _finish_dir(self, path: str, entry: Entry) -> None:
        afs = self.fs.aio
        st = await afs.stat(path)
        inode = await afs.engine.setattr(st.st_ino, mode=entry.mode, atime_ns=entry.atime_ns,
                                         mtime_ns=entry.mtime_ns)
        afs.engine.inodes.drop_if_idle(inode)

    def finish_dir(self, entry: Entry) -> None:
        self.fs.call(self._finish_dir, self.describe(entry.rel), entry)

    def close(self) -> None:
        self.fs.close()


@dataclass
class Summary:
    files: int = 0  # regular files in the source
    copied: int = 0
    skipped: int = 0  # already present with the same size and mtime
    bytes_total: int = 0
    bytes_copied: int = 0
    dirs: int = 0
    links: int = 0
    errors: list[str] = field(default_factory=list)
    interrupted: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        s = max(self.seconds, 1e-9)
        return {"files": self.files, "copied": self.copied, "skipped": self.skipped, "bytes": self.bytes_total,
                "bytes_copied": self.bytes_copied, "dirs": self.dirs, "symlinks": self.links,
                "errors": self.errors, "interrupted": self.interrupted, "seconds": round(self.seconds, 3),
                "files_per_s": round(self.copied / s, 1), "mib_per_s": round(self.bytes_copied / s / (1 << 20), 2)}


def same_file(st: os.stat_result | None, entry: Entry) -> bool:
    return st is not None and stat.S_ISREG(st.st_mode) and st.st_size == entry.size and \
        st.st_mtime_ns == entry.mtime_ns


class Importer:
    """One run: directories first (in order), then files and links with ``jobs`` in
    flight, then directory attributes. ``stop`` (a signal) lets the files in flight
    finish and starts no more."""

    def __init__(self, src: str, target: Target, jobs: int, progress: Any = None) -> None:
        self.src, self.target, self.jobs = src, target, jobs
        self.summary = Summary()
        self.stop = threading.Event()
        self.progress = progress
        self._lock = threading.Lock()
        self._fresh: set[str] = set()  # destination directories this run made: nothing to look up inside
        self._listings: dict[str, dict[str, os.stat_result]] = {}  # the others, listed once, as they are reached
        self._listing_lock = threading.Lock()
        self._task: Any = None
        self._started = time.monotonic()

    def _fail(self, where: str, exc: BaseException) -> None:
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        with self._lock:
            self.summary.errors.append(f"{shown(where)}: {msg}")

    def _advance(self, nbytes: int, copied: bool) -> None:
        with self._lock:
            if copied:
                self.summary.copied += 1
                self.summary.bytes_copied += nbytes
            else:
                self.summary.skipped += 1
            if self.progress is not None:
                done = self.summary.copied + self.summary.skipped
                rate = done / max(time.monotonic() - self._started, 1e-9)
                self.progress.update(self._task, advance=nbytes, files=done, rate=rate)

    def _existing(self, rel: str) -> os.stat_result | None:
        """What is at ``rel`` in the destination: a resumed import lists each directory
        once instead of looking every name up."""
        parent, name = os.path.split(rel)
        if parent in self._fresh:
            return None
        listing = self._listings.get(parent)
        if listing is None:
            with self._listing_lock:
                listing = self._listings.get(parent)
                if listing is None:
                    listing = self._listings[parent] = self.target.listing(parent)
        return listing.pop(name, None)

    def _make_dir(self, entry: Entry) -> None:
        st = self._existing(entry.rel)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            self.target.remove(entry.rel, False)
            st = None
        if st is None:
            self.target.mkdir(entry.rel)
            self._fresh.add(entry.rel)

    def _file(self, entry: Entry) -> None:
        st = self._existing(entry.rel)
        if same_file(st, entry):
            self._advance(entry.size, copied=False)
            return
        if st is not None and not stat.S_ISREG(st.st_mode):
            self.target.remove(entry.rel, stat.S_ISDIR(st.st_mode))
            st = None
        self.target.copy(os.path.join(self.src, entry.rel), entry, existed=st is not None)
        self._advance(entry.size, copied=True)

    def _link(self, entry: Entry) -> None:
        st = self._existing(entry.rel)
        if st is not None:
            if stat.S_ISLNK(st.st_mode) and self.target.readlink(entry.rel) == entry.target:
                return
            self.target.remove(entry.rel, stat.S_ISDIR(st.st_mode))
        self.target.symlink(entry)

    def _one(self, entry: Entry) -> None:
        try:
            (self._file if entry.kind == "file" else self._link)(entry)
        except OSError as exc:
            self._fail(self.target.describe(entry.rel), exc)

    def run(self) -> Summary:
        started = self._started = time.monotonic()
        s = self.summary
        entries = scan(self.src, s.errors)
        dirs = [e for e in entries if e.kind == "dir"]
        work = [e for e in entries if e.kind != "dir"]
        s.dirs, s.links = len(dirs), sum(e.kind == "link" for e in work)
        s.files = len(work) - s.links
        s.bytes_total = sum(e.size for e in work)
        if self.progress is not None:
            self._task = self.progress.add_task("import", total=s.bytes_total, files=0, total_files=s.files,
                                            rate=0.0)
        root = Entry("", "dir", 0, 0, 0, 0)
        failed_dirs: set[str] = set()
        for d in [root, *dirs]:
            if os.path.dirname(d.rel) in failed_dirs and d.rel:
                failed_dirs.add(d.rel)
                continue
            try:
                if d.rel:
                    self._make_dir(d)
                elif self.target.lstat("") is None:
                    raise FileNotFoundError(2, "the destination directory does not exist")
            except OSError as exc:
                self._fail(self.target.describe(d.rel), exc)
                failed_dirs.add(d.rel)
            if self.stop.is_set():
                break
        work = [e for e in work if os.path.dirname(e.rel) not in failed_dirs]
        with ThreadPoolExecutor(self.jobs, thread_name_prefix="import") as pool:
            inflight: set[Future[None]] = set()
            for entry in work:
                if self.stop.is_set():
                    break
                if len(inflight) >= 2 * self.jobs:
                    _, inflight = wait(inflight, timeout=None, return_when=FIRST_COMPLETED)
                inflight.add(pool.submit(self._one, entry))
            wait(inflight)
        if not self.stop.is_set():
            for d in reversed(dirs):  # deepest first: a parent's time is set after its children change it
                if d.rel in failed_dirs:
                    continue
                try:
                    self.target.finish_dir(d)
                except OSError as exc:
                    self._fail(self.target.describe(d.rel), exc)
        s.interrupted = self.stop.is_set()
        s.seconds = time.monotonic() - started
        return s


@contextlib.contextmanager
def stopping_on_signals(event: threading.Event) -> Iterator[list[int]]:
    """SIGINT and SIGTERM set ``event`` (the files in flight finish, then the summary);
    a second one stops at once."""
    got: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if event.is_set():
            raise KeyboardInterrupt
        got.append(signum)
        event.set()

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def progress_bar(enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    with Progress(TextColumn("{task.fields[files]:,}/{task.fields[total_files]:,} files"), BarColumn(),
                  DownloadColumn(), TransferSpeedColumn(), TextColumn("{task.fields[rate]:,.0f} files/s"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console) as bar:
        yield bar


def report(summary: Summary, as_json: bool) -> None:
    d = summary.as_dict()
    if as_json:
        click.echo(json.dumps(d, sort_keys=True))
        return
    state = "interrupted" if summary.interrupted else "done"
    click.echo(f"import {state}: {d['copied']:,} files copied ({d['bytes_copied']:,} bytes), "
               f"{d['skipped']:,} already present, {d['dirs']:,} directories, {d['symlinks']:,} symbolic links "
               f"in {d['seconds']:.1f} s ({d['files_per_s']:,.0f} files/s, {d['mib_per_s']:,.1f} MiB/s); "
               f"{len(d['errors'])} error(s)")
    for err in summary.errors[:50]:
        click.echo(f"  error: {err}", err=True)
    if len(summary.errors) > 50:
        click.echo(f"  ... and {len(summary.errors) - 50} more", err=True)


@click.command("import")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst")
@click.option("--jobs", "-j", type=click.IntRange(1, 256), default=8, show_default=True, help="Files in flight.")
@click.option("--volume", default=None,
              help="Copy into this volume through the native client (DST is a path inside it); needs --meta.")
@click.option("--meta", type=ADDRS, default=None, help="Metanode addresses (host:port,...), with --volume.")
@click.option("--zone", default="", help="The client's zone, with --volume.")
@click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False),
              help="A client credential or the cluster secret, with --volume (or set CACHEFS_SECRET).")
@click.option("--insecure", is_flag=True, envvar="CACHEFS_INSECURE", help="Talk to an insecure (lab) cluster.")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="The volume's mount token, with --volume.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--log-level", default="WARNING", show_default=True)
@tls_options
def command(src: str, dst: str, jobs: int, volume: str | None, meta: list[str] | None, zone: str,
            secret_file: str | None, insecure: bool, token_file: str | None, as_json: bool, quiet: bool,
            log_level: str, tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:
    """Copy the local tree SRC into DST (a directory in a mount, or with --volume a path in a volume).

    Files already at DST with the same size and modification time are skipped,
    so running the same command again resumes an interrupted import. Exits 1 if
    anything failed (each error names its path), 130 when interrupted.
    """
    setup_logging("import", log_level)
    target: Target
    if volume is not None:
        if not meta:
            raise click.UsageError("--volume needs --meta (the metanode addresses)")
        from cachefs.client.api import connect

        secret = load_secret(secret_file, insecure)
        load_tls(tls_cert, tls_key, tls_ca)  # a bad set is a usage error here, before connecting
        token = Path(token_file).read_text().strip() if token_file else None
        try:
            fs = connect(meta, volume, secret=secret, zone=zone, token=token, tls_cert=tls_cert, tls_key=tls_key,
                         tls_ca=tls_ca)
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"volume {volume}: {exc}") from None
        target = VolumeTarget(fs, dst)
    else:
        if not os.path.isdir(dst):
            raise click.UsageError(f"{dst}: not a directory (make it first, or give --volume)")
        target = MountTarget(dst)
    old_umask = os.umask(0)  # modes are the source's, exactly
    try:
        with progress_bar(not quiet) as bar:
            importer = Importer(os.path.abspath(src), target, jobs, bar)
            with stopping_on_signals(importer.stop) as got:
                summary = importer.run()
    finally:
        os.umask(old_umask)
        target.close()
    report(summary, as_json)
    if summary.interrupted:
        raise SystemExit(128 + (got[0] if got else signal.SIGINT))
    if summary.errors:
        raise SystemExit(1)
