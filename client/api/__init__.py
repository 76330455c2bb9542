"""The native Python API: a cachefs volume as a library, without FUSE.

Training code that reads through the mount pays a kernel round trip (and a
copy) per 128 KiB-1 MiB request; reading in-process skips both, as 3FS's
native API and CubeFS's AI-framework plugin do beside their FUSE clients.
The library runs the mount's own engine, not a second implementation: a
:class:`~cachefs.client.volume.Volume` (the session with its metanode calls,
cache-ring routing, backing-storage fallback and transports; L1, readahead
and one fetch per block however many readers ask; buffered writes cut into
slices and committed in order; compaction), with path calls on top. So what
the library writes, a mount sees after close, and the other way round
(close-to-open: every ``open``/``stat`` asks the metanodes).

Two entry points:

- trio-native: ``async with open_volume(meta_addrs, volume, secret=...) as fs``
  gives an :class:`AsyncFileSystem` whose workers (session upkeep, readahead,
  uploads) live in a nursery of the caller's run;
- synchronous: ``connect(meta_addrs, volume, secret=...)`` gives a
  :class:`FileSystem` that runs that same object on a trio loop in a
  background thread (one per client object) and calls into it with
  ``trio.from_thread``. It is safe to use from many threads at once. It does
  not survive ``fork``: a child process must connect on its own (the torch
  Dataset and the fsspec filesystem do that lazily per process).

A cluster that runs TLS (the daemons' ``--tls-cert/--tls-key/--tls-ca``)
takes the same three files here: ``tls_cert=``, ``tls_key=``, ``tls_ca=``
(all or none; TLS in the cluster is mutual, so the client shows a
certificate signed by ``tls_ca`` too). A volume with a mount token takes it
as ``token=``.

Paths are volume paths (``"a/b.bin"`` or ``"/a/b.bin"``); ``..`` in a path
is resolved lexically, symbolic links are followed (``lstat`` and
``readlink`` do not), and directory listings describe links as links.
Errors are raised as :class:`OSError` with the POSIX errno (so
``FileNotFoundError``, ``FileExistsError``...), the cachefs error chained as
``__cause__``: the library boundary is an edge, like the FUSE one.
"""

from ..volume import ClientOptions
from .asyncfs import AsyncFile, AsyncFileSystem, DirEntry, split_path, to_stat
from .startup import client_tls, open_volume
from .syncfs import File, FileSystem, connect

__all__ = [
    "AsyncFile",
    "AsyncFileSystem",
    "ClientOptions",
    "DirEntry",
    "File",
    "FileSystem",
    "client_tls",
    "connect",
    "open_volume",
    "split_path",
    "to_stat",
]
