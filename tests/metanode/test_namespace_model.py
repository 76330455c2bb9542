"""Hypothesis stateful test: random operation sequences against a small model.

The model is a deliberately naive namespace (dicts of names, sizes and link
counts, no usage counters, no packing); after every step the outcome (result
or errno) must match, every inode's type/size/nlink/blocks must match, listings
must match, and the fsck-style checker must find nothing. Snapshot/restore is
one of the steps, so persistence is exercised mid-sequence too. A file's
blocks are its writes' slices, each in 4 KiB blocks: the model keeps each
write, and drops one only when a later write or a punched hole covers it
whole or a truncate starts at or before it (a cut record keeps its slice).
"""

from __future__ import annotations

import errno

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cachefs import commands as C
from cachefs.errors import CacheFSError
from cachefs.ids import CHUNK_SIZE
from cachefs.metanode.namespace import MetaState
from cachefs.metanode.opentable import OpenTable

from .nsdriver import VOL, Driver

NAMES = st.sampled_from([b"a", b"b", b"c", b"d"])


class Model:
    def __init__(self) -> None:
        self.kind: dict[int, str] = {1: "d"}
        self.entries: dict[int, dict[bytes, int]] = {1: {}}
        self.parent: dict[int, int] = {1: 0}
        self.size: dict[int, int] = {1: 0}
        self.nlink: dict[int, int] = {}
        self.writes: dict[int, list[list[int]]] = {}  # file -> [chunk, pos, length, slice size]
        self.opens: dict[int, int] = {}
        self.next_ino = 2

    def dir(self, ino: int) -> dict[bytes, int]:
        if ino not in self.kind:
            raise _E(errno.ENOENT)
        if self.kind[ino] != "d":
            raise _E(errno.ENOTDIR)
        return self.entries[ino]

    def new(self, parent: int, name: bytes, kind: str) -> int:
        d = self.dir(parent)
        if name in d:
            raise _E(errno.EEXIST)
        ino = self.next_ino
        self.next_ino += 1
        self.kind[ino] = kind
        self.size[ino] = 1 if kind == "l" else 0
        if kind == "d":
            self.entries[ino] = {}
            self.parent[ino] = parent
        else:
            self.nlink[ino] = 1
        d[name] = ino
        return ino

    def drop(self, ino: int) -> None:
        if self.kind[ino] == "d":
            del self.kind[ino], self.entries[ino], self.parent[ino], self.size[ino]
            return
        self.nlink[ino] -= 1
        if self.nlink[ino] == 0 and not self.opens.get(ino):
            del self.kind[ino], self.nlink[ino], self.size[ino]
            self.writes.pop(ino, None)

    def blocks(self, ino: int) -> int:
        if self.kind[ino] == "d":
            return 8
        return sum((w[3] + 4095) // 4096 * 8 for w in self.writes.get(ino, ()))

    def write(self, ino: int, chunk: int, pos: int, length: int) -> None:
        self.regular(ino)
        self.size[ino] = max(self.size[ino], chunk * CHUNK_SIZE + pos + length)
        self.drop_covered(ino, chunk * CHUNK_SIZE + pos, chunk * CHUNK_SIZE + pos + length)
        self.writes.setdefault(ino, []).append([chunk, pos, length, length])

    def drop_covered(self, ino: int, lo: int, hi: int) -> None:
        kept = []
        for w in self.writes.get(ino, []):
            start = w[0] * CHUNK_SIZE + w[1]
            if not lo <= start <= start + w[2] <= hi:
                kept.append(w)
        self.writes[ino] = kept

    def truncate(self, ino: int, size: int) -> None:
        self.regular(ino)
        kept = []
        for chunk, pos, length, ssize in self.writes.get(ino, []):
            cut = size - chunk * CHUNK_SIZE
            if pos < cut:
                kept.append([chunk, pos, min(length, cut - pos), ssize])
        self.writes[ino] = kept
        self.size[ino] = size

    def punch(self, ino: int, lo: int, hi: int) -> None:
        self.regular(ino)
        hi = min(hi, self.size[ino])
        for chunk in range(lo // CHUNK_SIZE, (hi - 1) // CHUNK_SIZE + 1):  # a hole stops at its chunk's edges
            base = chunk * CHUNK_SIZE
            self.drop_covered(ino, max(lo, base), min(hi, base + CHUNK_SIZE))

    def unlink(self, parent: int, name: bytes, want_dir: bool) -> None:
        d = self.dir(parent)
        if name not in d:
            raise _E(errno.ENOENT)
        ino = d[name]
        if want_dir and self.kind[ino] != "d":
            raise _E(errno.ENOTDIR)
        if not want_dir and self.kind[ino] == "d":
            raise _E(errno.EISDIR)
        if want_dir and self.entries[ino]:
            raise _E(errno.ENOTEMPTY)
        del d[name]
        self.drop(ino)

    def link(self, ino: int, parent: int, name: bytes) -> None:
        if ino not in self.kind:
            raise _E(errno.ENOENT)
        if self.kind[ino] == "d":
            raise _E(errno.EPERM)
        if self.nlink[ino] == 0:
            raise _E(errno.ENOENT)
        d = self.dir(parent)
        if name in d:
            raise _E(errno.EEXIST)
        d[name] = ino
        self.nlink[ino] += 1

    def ancestors(self, ino: int) -> set[int]:
        out = set()
        while ino:
            out.add(ino)
            ino = self.parent[ino]
        return out

    def rename(self, sp: int, sn: bytes, dp: int, dn: bytes, flags: int) -> None:
        sd = self.dir(sp)
        dd = self.dir(dp)
        if sn not in sd:
            raise _E(errno.ENOENT)
        src = sd[sn]
        dst = dd.get(dn)
        if flags & C.RENAME_EXCHANGE:
            if dst is None:
                raise _E(errno.ENOENT)
            if src == dst:
                return
            if self.kind[src] == "d" and src in self.ancestors(dp):
                raise _E(errno.EINVAL)
            if self.kind[dst] == "d" and dst in self.ancestors(sp):
                raise _E(errno.EINVAL)
            sd[sn], dd[dn] = dst, src
            for ino, p in ((src, dp), (dst, sp)):
                if self.kind[ino] == "d":
                    self.parent[ino] = p
            return
        if dst is not None and flags & C.RENAME_NOREPLACE:
            raise _E(errno.EEXIST)
        if dst == src:
            return
        if self.kind[src] == "d" and src in self.ancestors(dp):
            raise _E(errno.EINVAL)
        if dst is not None:
            if self.kind[src] == "d" and self.kind[dst] != "d":
                raise _E(errno.ENOTDIR)
            if self.kind[src] != "d" and self.kind[dst] == "d":
                raise _E(errno.EISDIR)
            if self.kind[dst] == "d" and self.entries[dst]:
                raise _E(errno.ENOTEMPTY)
        del sd[sn]
        if dst is not None:
            del dd[dn]
            self.drop(dst)
        dd[dn] = src
        if self.kind[src] == "d":
            self.parent[src] = dp

    def regular(self, ino: int) -> None:
        if ino not in self.kind:
            raise _E(errno.ENOENT)
        if self.kind[ino] == "d":
            raise _E(errno.EISDIR)
        if self.kind[ino] != "f":
            raise _E(errno.EINVAL)


class _E(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def outcome(fn, *args):
    try:
        fn(*args)
    except CacheFSError as err:
        return err.errno
    except _E as err:
        return err.code
    return 0


class NamespaceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ns = Driver().volume()
        self.model = Model()
        self.session = self.ns.do(C.MountVolume, VOL).session
        self.table = OpenTable()  # what the leader does around the state machine
        self.table.known.add(self.session)

    def stamp(self, parent: int, name: bytes) -> tuple[int, bool]:
        expect = self.ns.state.predict_drop(VOL, parent, name)
        return expect, self.table.keep(self.ns.state, VOL, expect)

    def purge(self) -> None:
        orphans = self.ns.state.volumes[VOL].orphans
        inos = [i for i in sorted(orphans) if not self.table.is_open(VOL, i)]
        if inos:
            self.ns.do(C.PurgeOrphans, VOL, inos)

    def open_file(self, ino: int) -> None:
        self.ns.state.check_open(VOL, ino, self.session)
        self.table.open(VOL, self.session, ino)

    def inos(self) -> list[int]:
        return sorted(self.model.kind) + [self.model.next_ino]  # plus one that does not exist

    def files(self, data) -> int:
        regular = sorted(i for i, k in self.model.kind.items() if k == "f")
        if regular and data.draw(st.integers(0, 3)):
            return data.draw(st.sampled_from(regular))
        return data.draw(st.sampled_from(self.inos()))

    def entry(self, data) -> tuple[int, bytes]:
        """Mostly an existing (directory, name), sometimes anything."""
        existing = sorted((p, n) for p, d in self.model.entries.items() for n in d)
        if existing and data.draw(st.integers(0, 4)):
            return data.draw(st.sampled_from(existing))
        return data.draw(st.sampled_from(self.inos())), data.draw(NAMES)

    def same(self, got: int, want: int) -> None:
        assert got == want, f"state machine said {got}, model said {want}"

    @rule(data=st.data(), name=NAMES, kind=st.sampled_from(["f", "d", "l"]))
    def create(self, data, name, kind) -> None:
        parent = data.draw(st.sampled_from(self.inos()))
        if kind == "f":
            got = outcome(self.ns.create, parent, name)
        elif kind == "d":
            got = outcome(self.ns.mkdir, parent, name)
        else:
            got = outcome(self.ns.do, C.Symlink, VOL, parent, name, b"t", 0, 0)
        self.same(got, outcome(self.model.new, parent, name, kind))

    @rule(data=st.data(), rmdir=st.booleans())
    def remove(self, data, rmdir) -> None:
        parent, name = self.entry(data)
        if rmdir:
            got = outcome(self.ns.do, C.Rmdir, VOL, parent, name)
        else:
            got = outcome(self.ns.do, C.Unlink, VOL, parent, name, *self.stamp(parent, name))
            self.purge()
        self.same(got, outcome(self.model.unlink, parent, name, rmdir))

    @rule(data=st.data(), name=NAMES)
    def link(self, data, name) -> None:
        ino = self.files(data)
        parent = data.draw(st.sampled_from(self.inos()))
        got = outcome(self.ns.do, C.Link, VOL, ino, parent, name)
        self.same(got, outcome(self.model.link, ino, parent, name))

    @rule(data=st.data(), flags=st.sampled_from([0, 0, 1, 2]))
    def rename(self, data, flags) -> None:
        sp, sn = self.entry(data)
        dp, dn = self.entry(data)
        stamp = (0, True) if flags & C.RENAME_EXCHANGE else self.stamp(dp, dn)
        got = outcome(self.ns.do, C.Rename, VOL, sp, sn, dp, dn, flags, None, *stamp)
        self.purge()
        self.same(got, outcome(self.model.rename, sp, sn, dp, dn, flags))

    @rule(
        data=st.data(), chunk=st.integers(0, 2), pos=st.integers(0, 100), length=st.integers(1, 100)
    )
    def write(self, data, chunk, pos, length) -> None:
        ino = self.files(data)
        got = outcome(self.ns.write, ino, chunk, pos, length)
        self.same(got, outcome(self.model.write, ino, chunk, pos, length))

    @rule(data=st.data(), size=st.sampled_from([0, 50, CHUNK_SIZE + 20, 3 * CHUNK_SIZE]))
    def truncate(self, data, size) -> None:
        ino = self.files(data)
        got = outcome(self.ns.do, C.SetAttr, VOL, ino, None, None, None, size)
        self.same(got, outcome(self.model.truncate, ino, size))

    @rule(data=st.data(), chunk=st.integers(0, 2), pos=st.integers(0, 120), length=st.integers(1, 120))
    def punch(self, data, chunk, pos, length) -> None:
        ino = self.files(data)
        lo = chunk * CHUNK_SIZE + pos
        got = outcome(self.ns.do, C.Fallocate, VOL, ino, C.FALLOC_FL_PUNCH_HOLE | C.FALLOC_FL_KEEP_SIZE, lo, length)
        self.same(got, outcome(self.model.punch, ino, lo, lo + length))

    @rule(data=st.data())
    def open(self, data) -> None:
        ino = self.files(data)
        got = outcome(self.open_file, ino)
        want = outcome(self.model.regular, ino)
        if not want:
            self.model.opens[ino] = self.model.opens.get(ino, 0) + 1
        self.same(got, want)

    @rule(data=st.data())
    def release(self, data) -> None:
        opened = sorted(self.model.opens)
        ino = data.draw(st.sampled_from(opened)) if opened else self.files(data)
        if not self.model.opens.get(ino):
            return  # the client only releases what it opened
        self.model.opens[ino] -= 1
        if not self.model.opens[ino]:  # the client's last close: the leader hears it
            self.table.release(VOL, self.session, ino)
            self.purge()
            del self.model.opens[ino]
            if self.model.kind.get(ino) != "d" and self.model.nlink.get(ino) == 0:
                del self.model.kind[ino], self.model.nlink[ino], self.model.size[ino]
                self.model.writes.pop(ino, None)

    @rule()
    def snapshot_restore(self) -> None:
        blob = self.ns.state.snapshot()
        fresh = MetaState()
        fresh.restore(blob)
        assert fresh.snapshot() == blob
        self.ns.state = fresh

    @invariant()
    def matches_model(self) -> None:
        state = self.ns.state
        vol = state.volumes[VOL]
        assert set(vol.inodes) == set(self.model.kind)
        for ino, kind in self.model.kind.items():
            attr = state.getattr(VOL, ino)
            if kind == "d":
                listing = {e[0]: e[1].ino for e in state.readdir(VOL, ino, 0, 1000)}
                assert listing == self.model.entries[ino]
            else:
                assert attr.size == self.model.size[ino]
                assert attr.nlink == self.model.nlink[ino]
            assert attr.blocks == self.model.blocks(ino)
        self.ns.check()


NamespaceMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestNamespace = NamespaceMachine.TestCase
