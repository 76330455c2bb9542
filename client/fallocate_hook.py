"""FUSE_FALLOCATE for pyfuse3, which has no handler for it.

pyfuse3 (3.5, and upstream so far) leaves libfuse's ``fallocate`` operation
unset: libfuse answers ENOSYS and the kernel then fails every fallocate(2)
on the mount with EOPNOTSUPP. :func:`install` sets that one operation in the
running session. libfuse copies pyfuse3's ``fuse_lowlevel_ops`` into the
session at ``pyfuse3.init``; pyfuse3's module keeps both (its static
``fuse_ops`` and ``session``), whose addresses come from the symbol table
of its shared object. The copy is found by comparing it with the original,
and the slot must be empty, so a libfuse or pyfuse3 built differently is
detected: fallocate then stays unsupported (logged), nothing is written.

The handler is a ctypes callback that libfuse calls in the trio thread,
inside pyfuse3's ``fuse_session_process_buf``; it starts the request as a
task of the mount and answers it with ``fuse_reply_err``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

from cachefs.tasks import Spawner

log = logging.getLogger(__name__)

# struct fuse_lowlevel_ops (libfuse 3.x, fuse_lowlevel.h): 44 function
# pointers, fallocate the 41st (after flock), unchanged since libfuse 3.0.
OPS_POINTERS = 44
FALLOCATE_SLOT = 40
SESSION_SCAN = 256  # bytes of struct fuse_session searched for the copy
SYMBOLS = ("__pyx_v_7pyfuse3_fuse_ops", "__pyx_v_7pyfuse3_session", "PyInit_pyfuse3")

FALLOCATE = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p
)
Handler = Callable[[int, int, int, int], Awaitable[int]]  # (ino, mode, offset, length) -> errno

_installed: list[object] = []  # the callback must live as long as the session


class HookUnavailable(Exception):
    """This pyfuse3 or libfuse is not laid out as expected."""


def _symbols(path: str, names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """``name -> (value, size)`` from an ELF64 shared object's ``.symtab``."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise HookUnavailable(f"{path} is not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    found: dict[str, tuple[int, int]] = {}
    for sec in sections:
        if sec[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sec[6]]
        strings = data[strtab[4] : strtab[4] + strtab[5]]
        for off in range(sec[4], sec[4] + sec[5], 24):
            name_off, _info, _other, _shndx, value, size = struct.unpack_from("<IBBHQQ", data, off)
            end = strings.index(b"\0", name_off)
            name = strings[name_off:end].decode(errors="replace")
            if name in names:
                found[name] = (value, size)
    missing = [n for n in names if n not in found]
    if missing:
        raise HookUnavailable(f"{path} has no symbol {', '.join(missing)} (stripped?)")
    return found


def _session_ops(pyfuse3_path: str) -> int:
    """The address of the running session's copy of the operations."""
    syms = _symbols(pyfuse3_path, SYMBOLS)
    lib = ctypes.CDLL(pyfuse3_path)  # already loaded: the same handle
    base = ctypes.cast(lib.PyInit_pyfuse3, ctypes.c_void_p).value - syms["PyInit_pyfuse3"][0]
    ops_addr, ops_size = base + syms["__pyx_v_7pyfuse3_fuse_ops"][0], syms["__pyx_v_7pyfuse3_fuse_ops"][1]
    if ops_size != OPS_POINTERS * 8:
        raise HookUnavailable(f"fuse_lowlevel_ops is {ops_size} bytes, not {OPS_POINTERS * 8}")
    session = ctypes.c_void_p.from_address(base + syms["__pyx_v_7pyfuse3_session"][0]).value
    if not session:
        raise HookUnavailable("pyfuse3 has no session (call after pyfuse3.init)")
    ops = ctypes.string_at(ops_addr, ops_size)
    if ops[FALLOCATE_SLOT * 8 : FALLOCATE_SLOT * 8 + 8] != bytes(8):
        raise HookUnavailable("pyfuse3 already sets a fallocate operation")
    near = ctypes.string_at(session, SESSION_SCAN + ops_size)
    for off in range(0, SESSION_SCAN, 8):
        if near[off : off + ops_size] == ops:
            return session + off
    raise HookUnavailable("the session's copy of the operations was not found")


def install(handler: Handler, spawner: Spawner, pyfuse3_path: str) -> bool:
    """Route FUSE_FALLOCATE to ``handler`` (run as a task of ``spawner``);
    ``pyfuse3_path``: the loaded pyfuse3's shared object (``pyfuse3.__file__``).
    Returns False, having logged why, when this build cannot take it."""
    try:
        libfuse = ctypes.CDLL(ctypes.util.find_library("fuse3") or "libfuse3.so.3")
        reply_err = libfuse.fuse_reply_err
        reply_err.argtypes = [ctypes.c_void_p, ctypes.c_int]
        reply_err.restype = ctypes.c_int
        slot = _session_ops(pyfuse3_path) + FALLOCATE_SLOT * 8
    except (HookUnavailable, OSError, AttributeError, ValueError) as exc:
        log.warning("fallocate stays unsupported on this mount (EOPNOTSUPP): %s", exc)
        return False

    async def answer(req: int, ino: int, mode: int, offset: int, length: int) -> None:
        err = errno.EIO
        try:
            err = await handler(ino, mode, offset, length)
        finally:
            reply_err(req, err)  # every request gets exactly one answer

    @FALLOCATE
    def fallocate(req: int, ino: int, mode: int, offset: int, length: int, _fi: int) -> None:
        try:
            spawner.start_soon(answer, req, ino, mode, offset, length, name="fallocate")
        except BaseException:  # a ctypes callback must not raise
            log.exception("could not start fallocate of inode %d", ino)
            reply_err(req, errno.EIO)

    _installed.append(fallocate)
    ctypes.c_void_p.from_address(slot).value = ctypes.cast(fallocate, ctypes.c_void_p).value
    return True
