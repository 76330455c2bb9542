"""The running pyfuse3 session's table of libfuse operations, for what pyfuse3 lacks.

libfuse copies pyfuse3's ``fuse_lowlevel_ops`` into the session at
``pyfuse3.init``; pyfuse3's module keeps both (its static ``fuse_ops`` and
``session``), whose addresses come from the symbol table of its shared
object. The copy is found by comparing it with the original, so a libfuse
or pyfuse3 built differently is detected (:class:`HookUnavailable`) and
nothing is written. A hook then sets one slot of the copy:
:mod:`.fallocate_hook` and :mod:`.lseek_hook` empty ones, :mod:`.noflush_hook` a wrapper of
pyfuse3's ``open``, :mod:`.symlink_cache_hook` one of its ``init``,
:mod:`.dircache_hook` one of its ``opendir``. Find the table once, before any
hook changes it.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# struct fuse_lowlevel_ops (libfuse 3.x, fuse_lowlevel.h): 44 function
# pointers, in an order unchanged since libfuse 3.0.
OPS_POINTERS = 44
SLOTS = {"init": 0, "open": 14, "opendir": 20, "fallocate": 40, "lseek": 43}
SESSION_SCAN = 256  # bytes of struct fuse_session searched for the copy
SYMBOLS = ("__pyx_v_7pyfuse3_fuse_ops", "__pyx_v_7pyfuse3_session", "PyInit_pyfuse3")

_kept: list[object] = []  # wrappers and the functions they call: they must live as long as the session


class HookUnavailable(Exception):
    """This pyfuse3 or libfuse is not laid out as expected."""


@dataclass(frozen=True, slots=True)
class OpsTable:
    """The session's copy of the operations, and pyfuse3's original."""

    address: int
    original: bytes

    def slot(self, op: str) -> int:
        """The address of ``op``'s function pointer in the session's copy."""
        return self.address + SLOTS[op] * 8

    def pyfuse3_sets(self, op: str) -> bool:
        i = SLOTS[op] * 8
        return self.original[i : i + 8] != bytes(8)

    def wrap(self, op: str, cfunctype: Any, pyfunctype: Any, make: Callable[[Any], Callable[..., None]]) -> bool:
        """Put ``make(pyfuse3's op)`` in the session's ``op`` slot: libfuse
        calls it (as ``cfunctype``), and it calls pyfuse3's function back (as
        ``pyfunctype``: the GIL stays held, which pyfuse3's Cython code
        needs). False, and nothing written, when pyfuse3 sets no ``op``."""
        if not self.pyfuse3_sets(op):
            return False
        slot = self.slot(op)
        original = pyfunctype(ctypes.c_void_p.from_address(slot).value)
        wrapper = cfunctype(make(original))
        _kept.append((original, wrapper))
        ctypes.c_void_p.from_address(slot).value = ctypes.cast(wrapper, ctypes.c_void_p).value
        return True


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


def session_table(pyfuse3_path: str) -> OpsTable:
    """The running session's operations; ``pyfuse3_path``: the loaded
    pyfuse3's shared object (``pyfuse3.__file__``). Call after
    ``pyfuse3.init`` and before any hook.

    Raises:
        HookUnavailable: not this layout (or no session yet).
    """
    try:
        syms = _symbols(pyfuse3_path, SYMBOLS)
        lib = ctypes.CDLL(pyfuse3_path)  # already loaded: the same handle
        base = ctypes.cast(lib.PyInit_pyfuse3, ctypes.c_void_p).value
    except (OSError, AttributeError, ValueError) as exc:
        raise HookUnavailable(f"cannot read {pyfuse3_path}: {exc}") from None
    assert base is not None
    base -= syms["PyInit_pyfuse3"][0]
    ops_addr, ops_size = base + syms["__pyx_v_7pyfuse3_fuse_ops"][0], syms["__pyx_v_7pyfuse3_fuse_ops"][1]
    if ops_size != OPS_POINTERS * 8:
        raise HookUnavailable(f"fuse_lowlevel_ops is {ops_size} bytes, not {OPS_POINTERS * 8}")
    session = ctypes.c_void_p.from_address(base + syms["__pyx_v_7pyfuse3_session"][0]).value
    if not session:
        raise HookUnavailable("pyfuse3 has no session (call after pyfuse3.init)")
    ops = ctypes.string_at(ops_addr, ops_size)
    near = ctypes.string_at(session, SESSION_SCAN + ops_size)
    for off in range(0, SESSION_SCAN, 8):
        if near[off : off + ops_size] == ops:
            return OpsTable(session + off, ops)
    raise HookUnavailable("the session's copy of the operations was not found")
