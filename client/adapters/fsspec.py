"""fsspec filesystem for ``cachefs://VOLUME/PATH``, so pandas, pyarrow, Hugging
Face datasets and anything else built on fsspec read cachefs in-process.

Registered through the ``fsspec.specs`` entry point (``cachefs``), so
``fsspec.filesystem("cachefs", meta=...)`` and ``fsspec.open("cachefs://...")``
find it. The volume is the first path component, as the bucket is for s3fs;
each volume gets one :class:`cachefs.client.api.FileSystem` (its own session,
L1 cache and loop thread), made on first use and again after ``fork``.

Storage options (each falls back to an environment variable, so URLs work
with no options at all in a configured job):

- ``meta``: metanode addresses, a list or ``"h:p,h:p"`` (``CACHEFS_META``);
- ``secret`` (``CACHEFS_SECRET``) or ``secret_file`` (``CACHEFS_SECRET_FILE``),
  or ``insecure=True`` (``CACHEFS_INSECURE``) for a lab without a secret;
- ``zone``: this node's zone, whose cache ring is tried first (``CACHEFS_ZONE``);
- ``token``: the mount token of a volume that is not open: one string for
  every volume, or a ``{volume: token}`` dict (``CACHEFS_TOKEN``), or
  ``token_file``, a file holding it (``CACHEFS_TOKEN_FILE``, as ``cachefs
  mount --token-file``);
- ``tls_cert``, ``tls_key``, ``tls_ca``: PEM files for a cluster that runs
  TLS, all three or none, as ``cachefs mount --tls-*`` (``CACHEFS_TLS_CERT``,
  ``CACHEFS_TLS_KEY``, ``CACHEFS_TLS_CA``);
- ``client_options``: :class:`~cachefs.client.api.ClientOptions` fields;
- ``auto_mkdir`` (default True): writing a file creates its parent
  directories, as writing to an object store does (pandas, datasets and
  pyarrow writers expect that of remote filesystems).

Conventions kept: names in listings carry no protocol (``"vol/dir/file"``),
``info`` has ``name``, ``size``, ``type`` (``"file"``/``"directory"``) and
``mtime``; ``cat_file`` takes Python-slice ``start``/``end`` (negative from
the end); ``open`` modes are ``rb``, ``wb``, ``ab``, ``xb`` (text via
fsspec's wrapper); a missing path raises ``FileNotFoundError``. Inside
``with fs.transaction:`` a file opened for writing goes to a hidden
temporary name beside its target and is renamed into place (atomically, one
file at a time) when the transaction commits, or deleted when it is
discarded; ``touch(path, truncate=False)`` only updates the times of an
existing file. Listings are
not cached (``dircache`` stays empty): like the mount, every call sees the
metanodes' current namespace. The root (``cachefs://``) lists the volumes.
"""

from __future__ import annotations

import io
import os
import stat
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import trio
from fsspec import AbstractFileSystem
from fsspec.spec import AbstractBufferedFile

from cachefs.client.api import (
    AsyncFileSystem,
    ClientOptions,
    DirEntry,
    FileSystem,
    client_tls,
    connect,
)
from cachefs.credentials import Credential, read_secret
from cachefs.errors import CacheFSError, InvalidArgument

PARALLEL_RANGES = 16
COPY_CHUNK = 8 << 20
TXN_MARK = ".cachefs-txn-"  # temporary names of files written in a transaction
NAME_MAX = 255


def _read_option_file(option: str, path: str) -> bytes:
    """The stripped contents of a secret or token file, or a ValueError naming the option."""
    try:
        with open(path, "rb") as f:
            value = f.read().strip()
    except OSError as exc:
        raise ValueError(f"cachefs: {option} {path}: {exc.strerror}") from None
    if not value:
        raise ValueError(f"cachefs: {option} {path} is empty")
    return value


def _env_bool(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class CacheFSFileSystem(AbstractFileSystem):
    """``cachefs://VOLUME/PATH`` (see module docstring)."""

    protocol = "cachefs"
    root_marker = ""

    def __init__(
        self,
        meta: list[str] | str | None = None,
        secret: bytes | str | None = None,
        secret_file: str | None = None,
        insecure: bool | None = None,
        zone: str | None = None,
        client_options: dict[str, Any] | None = None,
        auto_mkdir: bool = True,
        token: str | Mapping[str, str] | None = None,
        token_file: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_ca: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.auto_mkdir = auto_mkdir
        meta = meta if meta is not None else os.environ.get("CACHEFS_META", "")
        self.meta = [
            a.strip() for a in (meta.split(",") if isinstance(meta, str) else meta) if a.strip()
        ]
        if not self.meta:
            raise ValueError("cachefs: no metanode addresses (give meta=... or set CACHEFS_META)")
        self.zone = zone if zone is not None else os.environ.get("CACHEFS_ZONE", "")
        self._secret = self._load_secret(secret, secret_file, insecure)
        self.client_options = ClientOptions(**(client_options or {}))
        self._token = self._load_token(token, token_file)
        env = os.environ.get
        self.tls_files = {
            "tls_cert": tls_cert or env("CACHEFS_TLS_CERT") or None,
            "tls_key": tls_key or env("CACHEFS_TLS_KEY") or None,
            "tls_ca": tls_ca or env("CACHEFS_TLS_CA") or None,
        }
        self._tls = client_tls(**self.tls_files)  # an incomplete set fails here, not at first use
        self._clients: dict[str, FileSystem] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _load_secret(
        secret: bytes | str | Credential | None, secret_file: str | None, insecure: bool | None
    ) -> bytes | Credential | None:
        if secret:
            return secret.encode() if isinstance(secret, str) else secret
        secret_file = secret_file or os.environ.get("CACHEFS_SECRET_FILE")
        if secret_file:
            _read_option_file("secret_file", secret_file)  # the errors name the option
            try:
                return read_secret(secret_file)  # the cluster secret or a credential
            except InvalidArgument as exc:
                raise ValueError(f"cachefs: secret_file {exc.message}") from None
        env = os.environ.get("CACHEFS_SECRET", "").strip()
        if env:
            return env.encode()
        if insecure or (insecure is None and _env_bool("CACHEFS_INSECURE")):
            return None
        raise ValueError("cachefs: no cluster secret (give secret=, secret_file= or set CACHEFS_SECRET_FILE; "
                         "insecure=True for a lab without one)")  # fmt: skip

    @staticmethod
    def _load_token(
        token: str | Mapping[str, str] | None, token_file: str | None
    ) -> str | dict[str, str] | None:
        if token:
            return token if isinstance(token, str) else dict(token)
        token_file = token_file or os.environ.get("CACHEFS_TOKEN_FILE")
        if token_file:
            return _read_option_file("token_file", token_file).decode()
        return os.environ.get("CACHEFS_TOKEN", "").strip() or None

    def token_for(self, volume: str) -> str | None:
        """The mount token given for ``volume`` (None: an open volume is expected)."""
        if isinstance(self._token, dict):
            return self._token.get(volume)
        return self._token

    # ------------------------------------------------------------------ plumbing

    def client(self, volume: str) -> FileSystem:
        """The native client of ``volume`` in this process (made on first use)."""
        with self._lock:
            fs = self._clients.get(volume)
            if fs is None or fs.pid != os.getpid() or fs.closed:
                fs = self._clients[volume] = connect(
                    self.meta,
                    volume,
                    secret=self._secret,
                    zone=self.zone,
                    options=self.client_options,
                    token=self.token_for(volume),
                    **self.tls_files,
                )
            return fs

    def _split(self, path: str) -> tuple[FileSystem, str, str]:
        """``(client, volume, path inside the volume)``."""
        path = self._strip_protocol(path).lstrip("/")
        volume, _, rest = path.partition("/")
        if not volume:
            raise ValueError("cachefs paths start with a volume: cachefs://VOLUME/PATH")
        return self.client(volume), volume, "/" + rest

    def close(self) -> None:
        """End every volume session this instance opened."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for fs in clients:
            if fs.pid == os.getpid():
                fs.close()

    @staticmethod
    def _info(name: str, st: os.stat_result) -> dict[str, Any]:
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        if stat.S_ISLNK(st.st_mode):
            kind = "link"
        return {
            "name": name,
            "size": st.st_size if kind == "file" else 0,
            "type": kind,
            "mode": st.st_mode,
            "ino": st.st_ino,
            "nlink": st.st_nlink,
            "uid": st.st_uid,
            "gid": st.st_gid,
            "mtime": st.st_mtime,
            "created": st.st_ctime,
        }

    def _name(self, volume: str, inner: str) -> str:
        return f"{volume}{inner.rstrip('/')}" if inner.strip("/") else volume

    # ------------------------------------------------------------------ reading the namespace

    def volumes(self) -> list[str]:
        """The cluster's volumes (what ``ls("")`` lists): asked of the metanodes
        on a short-lived connection, since no volume session is needed."""
        from cachefs.metanode.client import MetaClient
        from cachefs.queries import ListVolumes
        from cachefs.rpc import RpcPool

        async def ask() -> dict[str, Any]:
            async with RpcPool(secret=self._secret, tls=self._tls) as pool:
                return await MetaClient(pool, self.meta, deadline=10.0).query(ListVolumes())

        try:
            return sorted(name for name, v in trio.run(ask).items() if not v.get("deleted"))
        except CacheFSError as exc:
            raise OSError(exc.errno, exc.message) from exc

    def _is_root(self, path: str) -> bool:
        return not self._strip_protocol(path).strip("/")

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        if self._is_root(path):
            return {"name": "", "size": 0, "type": "directory"}
        fs, volume, inner = self._split(path)
        return self._info(self._name(volume, inner), fs.stat(inner))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        if self._is_root(path):
            vols = [{"name": v, "size": 0, "type": "directory"} for v in self.volumes()]
            return vols if detail else [v["name"] for v in vols]
        fs, volume, inner = self._split(path)
        try:
            entries: list[DirEntry] = fs.scandir(inner)
        except NotADirectoryError:
            info = self.info(path)
            return [info] if detail else [info["name"]]
        base = self._name(volume, inner)
        out = [
            self._info(f"{base}/{e.name}", e.stat) for e in sorted(entries, key=lambda e: e.name)
        ]
        return out if detail else [e["name"] for e in out]

    def created(self, path: str) -> Any:
        import datetime

        return datetime.datetime.fromtimestamp(self.info(path)["created"], tz=datetime.UTC)

    def modified(self, path: str) -> Any:
        import datetime

        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], tz=datetime.UTC)

    # ------------------------------------------------------------------ data

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        fs, _, inner = self._split(path)
        return fs.read_bytes(inner, start or 0, end)

    def cat_ranges(
        self,
        paths: list[str],
        starts: list[int | None] | int | None,
        ends: list[int | None] | int | None,
        max_gap: int | None = None,
        on_error: str = "return",
        **kwargs: Any,
    ) -> list[Any]:
        """Ranges read concurrently (bounded), results in the order asked.

        ``max_gap`` (fsspec's hint to merge nearby ranges into one request) is
        accepted and not needed: each range is already read exactly, in parallel.
        """
        if not isinstance(paths, list):
            raise TypeError("paths must be a list")
        starts_l = starts if isinstance(starts, list) else [starts] * len(paths)
        ends_l = ends if isinstance(ends, list) else [ends] * len(paths)
        if len(starts_l) != len(paths) or len(ends_l) != len(paths):
            raise ValueError("paths, starts and ends differ in length")
        out: list[Any] = [None] * len(paths)
        by_volume: dict[str, list[int]] = {}
        split = [self._split(p) for p in paths]
        for i, (_, volume, _) in enumerate(split):
            by_volume.setdefault(volume, []).append(i)
        for indices in by_volume.values():
            fs = split[indices[0]][0]
            jobs = [(i, split[i][2], starts_l[i] or 0, ends_l[i]) for i in indices]
            fs.call(_read_ranges, fs.aio, jobs, out)
        if on_error != "return":
            for item in out:
                if isinstance(item, BaseException):
                    raise item
        return out

    def _parents_for_write(self, fs: FileSystem, inner: str) -> None:
        parent = inner.rstrip("/").rsplit("/", 1)[0]
        if self.auto_mkdir and parent.strip("/"):
            fs.makedirs(parent, exist_ok=True)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        if self._intrans:  # deferred like any other write of the transaction
            with self.open(path, "xb" if mode == "create" else "wb") as f:
                f.write(value)
            return
        fs, _, inner = self._split(path)
        self._parents_for_write(fs, inner)
        with fs.open(inner, "xb" if mode == "create" else "wb") as f:
            f.write(value)

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        fs, _, inner = self._split(path)
        if "r" not in mode:
            self._parents_for_write(fs, inner)
            if not autocommit:
                return TransactionFile(self, path, mode, block_size, fs, inner)
        return fs.open(inner, mode, buffering=block_size or -1)

    # ------------------------------------------------------------------ changing the namespace

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        fs, _, inner = self._split(path)
        if create_parents:
            fs.makedirs(inner, exist_ok=False)
        else:
            fs.mkdir(inner)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        fs, _, inner = self._split(path)
        fs.makedirs(inner, exist_ok=exist_ok)

    def rmdir(self, path: str) -> None:
        fs, _, inner = self._split(path)
        fs.rmdir(inner)

    def rm_file(self, path: str) -> None:
        fs, _, inner = self._split(path)
        fs.remove(inner)

    def _rm(self, path: str) -> None:
        """One path of ``rm``: directories (reached last in ``rm(recursive=True)``) too."""
        fs, _, inner = self._split(path)
        if fs.isdir(inner):
            fs.rmdir(inner)
        else:
            fs.remove(inner)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for p in reversed(self.expand_path(path, recursive=recursive, maxdepth=maxdepth)):
            self._rm(p)

    def mv(
        self,
        path1: str,
        path2: str,
        recursive: bool = False,
        maxdepth: int | None = None,
        **kwargs: Any,
    ) -> None:
        """A rename within a volume (atomic, any size); across volumes copy then delete."""
        fs1, vol1, inner1 = self._split(path1)
        _, vol2, inner2 = self._split(path2)
        if vol1 == vol2 and isinstance(path1, str) and isinstance(path2, str):
            fs1.rename(inner1, inner2)
            return
        super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        src, _, inner1 = self._split(path1)
        dst, _, inner2 = self._split(path2)
        if src.isdir(inner1):
            dst.makedirs(inner2, exist_ok=True)
            return
        out = self.open(path2, "wb") if self._intrans else dst.open(inner2, "wb")  # deferred in one
        with src.open(inner1, "rb") as fin, out as fout:
            while chunk := fin.read(COPY_CHUNK):
                fout.write(chunk)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        """Create an empty file (truncating an existing one), or with
        ``truncate=False`` set an existing file's times to now and leave its data."""
        fs, _, inner = self._split(path)
        if not truncate:
            try:
                fs.utime(inner)
                return
            except FileNotFoundError:
                pass
        self._parents_for_write(fs, inner)
        fs.write_bytes(inner, b"")


class TransactionFile(AbstractBufferedFile):
    """A file written inside an fsspec transaction (``autocommit=False``).

    Why a temporary name: other readers must see the old file (or none)
    until the transaction commits, and a whole set of files must be
    droppable. The bytes go to a hidden name in the target's directory, so
    :meth:`commit` is one atomic rename within the volume and :meth:`discard`
    one unlink; ``close`` stores the data under the temporary name only.
    """

    def __init__(self, fs: CacheFSFileSystem, path: str, mode: str, block_size: int | None,
                 client: FileSystem, inner: str) -> None:  # fmt: skip
        if mode == "xb" and client.exists(inner):  # before the base class: nothing to close yet
            raise FileExistsError(17, "File exists", path)
        head, _, name = inner.rstrip("/").rpartition("/")
        temp = f"{TXN_MARK}{uuid.uuid4().hex[:16]}-{name}"
        if len(os.fsencode(temp)) > NAME_MAX:
            temp = temp[: len(TXN_MARK) + 16]
        self.client = client
        self.target = inner
        self.temp = f"{head}/{temp}"
        self.committed = False
        self._raw = client.open(self.temp, "xb", buffering=0)
        super().__init__(fs, path, mode=mode, block_size=block_size or "default", autocommit=False)
        try:
            if mode == "ab":  # the transaction appends to what the target holds now
                try:
                    with client.open(inner, "rb") as src:
                        while chunk := src.read(COPY_CHUNK):
                            self._raw.write(chunk)
                except FileNotFoundError:
                    pass
        except BaseException:
            self.closed = True
            self._drop()
            raise

    def _upload_chunk(self, final: bool = False) -> bool:
        self._raw.write(self.buffer.getvalue())
        if final:
            self._raw.close()  # commits the bytes, still under the temporary name
        return True

    def commit(self) -> None:
        """Move the written file into place (replacing what was there)."""
        if self.committed:
            return
        if not self.closed:
            self.close()
        self.client.rename(self.temp, self.target)
        self.committed = True

    def discard(self) -> None:
        """Throw the written bytes away; the target stays as it was."""
        if self.committed:
            return
        self.buffer = io.BytesIO()
        self.closed = True
        self._drop()

    def _drop(self) -> None:
        try:
            self._raw.close()
        finally:
            try:
                self.client.remove(self.temp)
            except FileNotFoundError:
                pass


async def _read_ranges(
    afs: AsyncFileSystem, jobs: list[tuple[int, str, int, int | None]], out: list[Any]
) -> None:
    limit = trio.Semaphore(PARALLEL_RANGES)

    async def one(i: int, inner: str, start: int, end: int | None) -> None:
        async with limit:
            try:
                out[i] = await afs.read_bytes(inner, start, end)
            except OSError as exc:
                out[i] = exc

    async with trio.open_nursery() as nursery:
        for job in jobs:
            nursery.start_soon(one, *job)
