"""One error tree for every part of cachefs.

Every error carries a wire ``code``: an errno name (``ENOENT``, ``EEXIST``...)
where POSIX has one, or a cachefs name (``ENOTLEADER``, ``EAUTH``...) where it
does not. The code is what crosses the wire (see ``cachefs.wire``); the caller
re-raises the same class from it with :func:`error_from_wire`, marked
``remote=True`` so logs say who was at fault. The FUSE boundary maps any of
them to ``FUSEError(err.errno)``.

OS and trio exceptions are mapped into this tree only at the edges (the RPC
driver, the shard and block stores), never deep inside a core.
"""

from __future__ import annotations

import errno as _errno
from typing import Any, ClassVar


class CacheFSError(Exception):
    """Base of every cachefs error.

    ``details`` is a small msgpack-able dict that travels with the error (for
    example the leader hint of :class:`NotLeader`).
    """

    code: ClassVar[str] = "EIO"
    errno: ClassVar[int] = _errno.EIO

    def __init__(self, message: str = "", *, remote: bool = False, **details: Any) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        self.remote = remote
        self.details = details

    def __str__(self) -> str:
        where = " (remote)" if self.remote else ""
        return f"[{self.code}]{where} {self.message}"


_BY_CODE: dict[str, type[CacheFSError]] = {}


def _register(cls: type[CacheFSError]) -> type[CacheFSError]:
    _BY_CODE[cls.code] = cls
    return cls


def _posix(name: str, code: str, errno_value: int, doc: str) -> type[CacheFSError]:
    cls = type(name, (CacheFSError,), {"code": code, "errno": errno_value, "__doc__": doc})
    return _register(cls)


IOFailure = _posix("IOFailure", "EIO", _errno.EIO, "Generic I/O failure.")
NotFound = _posix("NotFound", "ENOENT", _errno.ENOENT, "No such file, key or object.")
Exists = _posix("Exists", "EEXIST", _errno.EEXIST, "The name or key already exists.")
NotEmpty = _posix("NotEmpty", "ENOTEMPTY", _errno.ENOTEMPTY, "Directory not empty.")
NotADirectory = _posix("NotADirectory", "ENOTDIR", _errno.ENOTDIR, "A path component is not a directory.")
IsADirectory = _posix("IsADirectory", "EISDIR", _errno.EISDIR, "The target is a directory.")
NameTooLong = _posix("NameTooLong", "ENAMETOOLONG", _errno.ENAMETOOLONG, "A name is over 255 bytes.")
InvalidArgument = _posix("InvalidArgument", "EINVAL", _errno.EINVAL, "An argument is malformed or out of range.")
PermissionDenied = _posix("PermissionDenied", "EACCES", _errno.EACCES, "Permission denied.")
NotPermitted = _posix("NotPermitted", "EPERM", _errno.EPERM, "Operation not permitted.")
NoSpace = _posix("NoSpace", "ENOSPC", _errno.ENOSPC, "No space left on the device or node.")
QuotaExceeded = _posix("QuotaExceeded", "EDQUOT", _errno.EDQUOT, "A directory quota would be exceeded.")
FileTooLarge = _posix("FileTooLarge", "EFBIG", _errno.EFBIG, "A size or write offset is past the largest file.")
CrossDevice = _posix("CrossDevice", "EXDEV", _errno.EXDEV, "The operation spans two volumes.")
TooManyLinks = _posix("TooManyLinks", "ELOOP", _errno.ELOOP, "Too many symbolic links, or a rename into its own subtree.")
NoData = _posix("NoData", "ENODATA", _errno.ENODATA, "No such extended attribute.")
Range = _posix("Range", "ERANGE", _errno.ERANGE, "A value does not fit the given buffer.")
TimedOut = _posix("TimedOut", "ETIMEDOUT", _errno.ETIMEDOUT, "A call passed its deadline.")
Busy = _posix("Busy", "EBUSY", _errno.EBUSY, "The node is over a load limit; try another one.")
Stale = _posix("Stale", "ESTALE", _errno.ESTALE,
               "A conditional change was refused: what it was based on has changed (read again; not retried).")
NoSuchMethod = _posix("NoSuchMethod", "ENOSYS", _errno.ENOSYS, "The peer has no such RPC method.")
ConnectionLost = _posix("ConnectionLost", "ECONNRESET", _errno.ECONNRESET, "The connection to a peer broke.")
Unreachable = _posix("Unreachable", "ECONNREFUSED", _errno.ECONNREFUSED, "A peer could not be reached.")
ReadOnly = _posix("ReadOnly", "EROFS", _errno.EROFS, "The filesystem or node is read-only.")
NotSupported = _posix("NotSupported", "EOPNOTSUPP", _errno.EOPNOTSUPP, "The operation or mode is not supported.")
FrameTooLarge = _posix("FrameTooLarge", "EMSGSIZE", _errno.EMSGSIZE, "A frame is over the size limit.")

# cachefs codes without a POSIX name; they map to the nearest errno for FUSE.
NotLeader = _posix("NotLeader", "ENOTLEADER", _errno.EAGAIN, "This metanode is not the leader; details['leader'] may name it.")
AuthFailed = _posix("AuthFailed", "EAUTH", _errno.EACCES, "The peer did not prove knowledge of the cluster secret.")
ProtocolError = _posix("ProtocolError", "EPROTO", _errno.EPROTO, "A malformed frame or message.")
Unavailable = _posix("Unavailable", "EUNAVAIL", _errno.EIO, "Too few shards or replicas are reachable to serve the data.")
Corrupt = _posix("Corrupt", "ECORRUPT", _errno.EIO, "Stored data failed its checksum.")
SliceExpired = _posix("SliceExpired", "ESLICEEXPIRED", _errno.EIO,
                      "The slice id was sealed before its commit (held too long); store the data under a new one.")
CacheMiss = _posix("CacheMiss", "EMISS", _errno.EAGAIN, "Cache miss under the fast-fail policy; the node is filling the block.")


def error_from_wire(code: str, message: str, details: dict[str, Any] | None = None) -> CacheFSError:
    """Rebuild the typed error a peer sent; unknown codes become ``IOFailure``."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return IOFailure(f"{code}: {message}", remote=True, **(details or {}))
    return cls(message, remote=True, **(details or {}))
