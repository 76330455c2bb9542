"""A direct driver for the pure state machine: builds commands, applies them,
raises failures as typed errors. Shared by the namespace tests."""

from __future__ import annotations

import itertools
from typing import Any

from cachefs import commands as C
from cachefs.messages import Attr
from cachefs.metanode.invariants import check
from cachefs.metanode.namespace import Failure, MetaState

VOL = "vol"


class Driver:
    def __init__(self, state: MetaState | None = None, client: str = "t") -> None:
        self.state = state or MetaState()
        self.client = client
        self.seq = itertools.count(1)
        self.index = itertools.count(1)
        self.clock = itertools.count(1_000_000_000, 1000)

    def do(self, cls: type[C.Command], *args: Any, **kw: Any) -> Any:
        cmd = cls(*args, client_id=self.client, seq=next(self.seq), now_ns=next(self.clock), **kw)
        result = self.state.apply(next(self.index), cmd.encode())
        if isinstance(result, Failure):
            raise result.error()
        return result

    def volume(self, name: str = VOL) -> Driver:
        self.do(C.CreateVolume, name, "replica:3", "none", 4 << 20, 8)
        return self

    # namespace shorthands on VOL
    def create(self, parent: int, name: bytes, mode: int = 0o100644) -> Attr:
        return self.do(C.Mknod, VOL, parent, name, mode, 0, 0, 0)

    def mkdir(self, parent: int, name: bytes) -> Attr:
        return self.do(C.Mkdir, VOL, parent, name, 0o755, 0, 0)

    def write(self, ino: int, chunk: int, pos: int, length: int) -> Attr:
        first = self.do(C.AllocSlices, 1)
        return self.do(C.WriteSlice, VOL, ino, chunk, first, pos, length, 0, next(self.clock))

    def check(self) -> None:
        check(self.state)
