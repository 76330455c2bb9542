"""Operation-by-operation tests of the namespace state machine, errors included."""

from __future__ import annotations

import errno
import stat

import msgpack
import pytest
import zstandard

from cachefs import commands as C
from cachefs.errors import CacheFSError, SliceExpired
from cachefs.ids import CHUNK_SIZE
from cachefs.messages import Usage
from cachefs.metanode.invariants import check
from cachefs.metanode.namespace import DEDUP_WINDOW, Failure, MetaState

from .nsdriver import VOL, Driver


def errno_of(fn, *args, **kw) -> int:
    with pytest.raises(CacheFSError) as info:
        fn(*args, **kw)
    return info.value.errno


@pytest.fixture
def ns() -> Driver:
    return Driver().volume()


def test_create_lookup_getattr(ns: Driver) -> None:
    a = ns.create(1, b"f")
    assert stat.S_ISREG(a.mode) and a.nlink == 1 and a.size == 0
    assert ns.state.lookup(VOL, 1, b"f") == a
    assert ns.state.getattr(VOL, a.ino) == a
    assert errno_of(ns.state.lookup, VOL, 1, b"g") == errno.ENOENT
    assert errno_of(ns.state.lookup, VOL, a.ino, b"x") == errno.ENOTDIR
    assert errno_of(ns.state.getattr, VOL, 999) == errno.ENOENT
    assert errno_of(ns.state.getattr, "nope", 1) == errno.ENOENT
    assert errno_of(ns.create, 1, b"f") == errno.EEXIST
    assert errno_of(ns.create, 999, b"x") == errno.ENOENT
    assert errno_of(ns.create, a.ino, b"x") == errno.ENOTDIR
    ns.check()


def test_names_are_validated_before_the_log(ns: Driver) -> None:
    assert errno_of(ns.create, 1, b"x" * 256) == errno.ENAMETOOLONG
    ns.create(1, b"x" * 255)
    for bad in (b"", b".", b"..", b"a/b", b"a\0b"):
        assert errno_of(ns.create, 1, bad) == errno.EINVAL
    assert errno_of(ns.state.lookup, VOL, 1, b"y" * 256) == errno.ENAMETOOLONG
    with pytest.raises(CacheFSError):
        C.Mknod(VOL, 1, "str-name", 0o644, 0, 0, 0, client_id="c", seq=1, now_ns=0)  # type: ignore[arg-type]
    ns.check()


def test_malformed_log_entries_change_nothing(ns: Driver) -> None:
    before = ns.state.snapshot()
    for raw in (
        b"",
        b"\xc1",
        msgpack.packb([999, []]),
        msgpack.packb([11, [1, 2]]),
        msgpack.packb([11, ["c", 1, 0, VOL, 1, b"x", "bad-mode", 0, 0, 0]]),
        msgpack.packb([11, ["c", 1, 0, VOL, 1, b"x" * 300, 0o644, 0, 0, 0]]),
    ):
        result = ns.state.apply(0, raw)
        assert isinstance(result, Failure)
    assert ns.state.snapshot() == before


def test_mknod_kinds_and_mode_checks(ns: Driver) -> None:
    assert stat.S_ISREG(ns.create(1, b"plain", 0o644).mode)
    dev = ns.do(C.Mknod, VOL, 1, b"dev", stat.S_IFCHR | 0o600, 0x0501, 0, 0)
    assert stat.S_ISCHR(dev.mode) and dev.rdev == 0x0501
    assert stat.S_ISFIFO(ns.create(1, b"fifo", stat.S_IFIFO | 0o644).mode)
    assert errno_of(ns.create, 1, b"d", stat.S_IFDIR | 0o755) == errno.EINVAL
    assert errno_of(ns.create, 1, b"l", stat.S_IFLNK | 0o777) == errno.EINVAL
    assert errno_of(ns.create, 1, b"m", 0o1000000 | 0o644) == errno.EINVAL
    assert errno_of(ns.create, 1, b"n", -1) == errno.EINVAL
    ns.check()


def test_mkdir_rmdir_nlink(ns: Driver) -> None:
    d = ns.mkdir(1, b"d")
    assert stat.S_ISDIR(d.mode) and d.nlink == 2
    assert ns.state.getattr(VOL, 1).nlink == 3
    ns.mkdir(d.ino, b"e")
    assert ns.state.getattr(VOL, d.ino).nlink == 3
    assert errno_of(ns.mkdir, 1, b"d") == errno.EEXIST
    assert errno_of(ns.do, C.Rmdir, VOL, 1, b"d") == errno.ENOTEMPTY
    f = ns.create(1, b"f")
    assert errno_of(ns.do, C.Rmdir, VOL, 1, b"f") == errno.ENOTDIR
    assert errno_of(ns.do, C.Unlink, VOL, 1, b"d") == errno.EISDIR
    assert errno_of(ns.do, C.Rmdir, VOL, 1, b"zz") == errno.ENOENT
    assert errno_of(ns.do, C.Rmdir, VOL, f.ino, b"zz") == errno.ENOTDIR
    ns.do(C.Rmdir, VOL, d.ino, b"e")
    ns.do(C.Rmdir, VOL, 1, b"d")
    assert ns.state.getattr(VOL, 1).nlink == 2
    assert errno_of(ns.state.getattr, VOL, d.ino) == errno.ENOENT
    assert errno_of(ns.mkdir, d.ino, b"x") == errno.ENOENT
    ns.check()


def test_symlink_readlink(ns: Driver) -> None:
    s = ns.do(C.Symlink, VOL, 1, b"s", b"../target", 5, 6)
    assert stat.S_ISLNK(s.mode) and s.size == 9 and s.uid == 5
    assert ns.state.readlink(VOL, s.ino) == b"../target"
    f = ns.create(1, b"f")
    assert errno_of(ns.state.readlink, VOL, f.ino) == errno.EINVAL
    assert errno_of(ns.do, C.Symlink, VOL, 1, b"t", b"", 0, 0) == errno.ENOENT
    assert errno_of(ns.do, C.Symlink, VOL, 1, b"t", b"x" * 4096, 0, 0) == errno.ENAMETOOLONG
    assert errno_of(ns.do, C.Symlink, VOL, 1, b"s", b"x", 0, 0) == errno.EEXIST
    ns.check()


def test_hard_links(ns: Driver) -> None:
    d = ns.mkdir(1, b"d")
    f = ns.create(1, b"f")
    ns.write(f.ino, 0, 0, 100)
    a = ns.do(C.Link, VOL, f.ino, d.ino, b"g")
    assert a.nlink == 2 and a.ino == f.ino
    ns.do(C.Link, VOL, f.ino, d.ino, b"h")
    assert ns.state.usage(VOL, d.ino).bytes == 200  # every link counts in its directory
    ns.check()
    assert errno_of(ns.do, C.Link, VOL, d.ino, 1, b"dl") == errno.EPERM
    assert errno_of(ns.do, C.Link, VOL, f.ino, 1, b"f") == errno.EEXIST
    assert errno_of(ns.do, C.Link, VOL, 999, 1, b"q") == errno.ENOENT
    assert errno_of(ns.do, C.Link, VOL, f.ino, f.ino, b"q") == errno.ENOTDIR
    ns.do(C.Unlink, VOL, 1, b"f")
    assert ns.state.getattr(VOL, f.ino).nlink == 2
    ns.write(f.ino, 0, 100, 50)
    assert ns.state.usage(VOL, d.ino).bytes == 300
    assert ns.state.usage(VOL, 1).bytes == 300
    ns.do(C.Unlink, VOL, d.ino, b"g")
    ns.do(C.Unlink, VOL, d.ino, b"h")
    assert errno_of(ns.state.getattr, VOL, f.ino) == errno.ENOENT
    assert {r[0] for r in ns.state.trash(VOL, 100)} == {1, 2}
    ns.check()


def test_setattr(ns: Driver) -> None:
    f = ns.create(1, b"f")
    a = ns.do(C.SetAttr, VOL, f.ino, mode=0o600, uid=7, gid=8, atime_ns=5, mtime_ns=6)
    assert stat.S_IMODE(a.mode) == 0o600 and stat.S_ISREG(a.mode)
    assert (a.uid, a.gid, a.atime_ns, a.mtime_ns) == (7, 8, 5, 6)
    assert a.ctime_ns > 6
    a = ns.do(C.SetAttr, VOL, f.ino, mode=stat.S_IFREG | 0o4755)
    assert stat.S_IMODE(a.mode) == 0o4755
    assert errno_of(ns.do, C.SetAttr, VOL, f.ino, mode=stat.S_IFDIR | 0o755) == errno.EINVAL
    assert errno_of(ns.do, C.SetAttr, VOL, 1, size=0) == errno.EISDIR
    s = ns.do(C.Symlink, VOL, 1, b"s", b"t", 0, 0)
    assert errno_of(ns.do, C.SetAttr, VOL, s.ino, size=0) == errno.EINVAL
    assert errno_of(ns.do, C.SetAttr, VOL, f.ino, size=-1) == errno.EINVAL
    assert errno_of(ns.do, C.SetAttr, VOL, f.ino, uid=1 << 32) == errno.EINVAL
    assert errno_of(ns.do, C.SetAttr, VOL, 999, uid=1) == errno.ENOENT
    ns.check()


def test_write_read_truncate_and_trash(ns: Driver) -> None:
    f = ns.create(1, b"f").ino
    a = ns.write(f, 0, 0, 1000)
    assert a.size == 1000 and a.version == 2
    ns.write(f, 0, 500, 1000)
    ns.write(f, 1, 10, 10)
    assert ns.state.getattr(VOL, f).size == CHUNK_SIZE + 20
    assert ns.state.read_chunk(VOL, f, 0) == [(1, 0, 1000, 0), (2, 500, 1000, 0)]
    ns.write(f, 0, 0, 2000)  # covers both older slices: they go to the trash
    assert ns.state.read_chunk(VOL, f, 0) == [(4, 0, 2000, 0)]
    assert [r[:2] for r in ns.state.trash(VOL, 10)] == [(1, 1000), (2, 1000)]
    v = ns.state.getattr(VOL, f).version
    a = ns.do(C.SetAttr, VOL, f, size=1500)
    assert a.size == 1500 and a.version == v + 1
    assert ns.state.read_chunk(VOL, f, 0) == [(4, 0, 1500, 0)]
    assert ns.state.read_chunk(VOL, f, 1) == []
    assert [r[0] for r in ns.state.trash(VOL, 10)] == [1, 2, 3]
    ns.do(C.SetAttr, VOL, f, size=3 * CHUNK_SIZE)  # grow: a hole, no slices
    assert ns.state.read_chunk(VOL, f, 2) == []
    ns.check()
    ns.do(C.PurgeTrash, VOL, [1, 3])
    assert [r[0] for r in ns.state.trash(VOL, 10)] == [2]
    d = ns.mkdir(1, b"d").ino
    assert errno_of(ns.write, d, 0, 0, 1) == errno.EISDIR
    assert errno_of(ns.do, C.WriteSlice, VOL, f, 0, 10_000, 0, 1, 0, 0) == errno.EINVAL
    assert errno_of(ns.do, C.WriteSlice, VOL, f, 0, 4, CHUNK_SIZE - 1, 2, 0, 0) == errno.EINVAL
    assert errno_of(ns.do, C.WriteSlice, VOL, f, 0, 4, 0, 0, 0, 0) == errno.EINVAL
    assert errno_of(ns.state.read_chunk, VOL, d, 0) == errno.EISDIR
    ns.check()


def test_many_slices_switch_to_per_chunk_storage(ns: Driver) -> None:
    f = ns.create(1, b"f").ino
    for i in range(200):
        ns.write(f, i % 7, i * 100, 50)
    assert isinstance(ns.state.volumes[VOL].inodes[f].data, dict)
    assert len(ns.state.read_chunk(VOL, f, 3)) == len(range(3, 200, 7))
    ns.do(C.SetAttr, VOL, f, size=3 * CHUNK_SIZE + 5000)
    assert all(p + n <= 5000 for _s, p, n, _o in ns.state.read_chunk(VOL, f, 3))
    assert ns.state.read_chunk(VOL, f, 4) == []
    ns.check()


def test_compact_chunk(ns: Driver) -> None:
    f = ns.create(1, b"f").ino
    ns.write(f, 0, 0, 10)
    ns.write(f, 0, 5, 10)
    new = ns.do(C.AllocSlices, 1)
    records = [1, 0, 10, 0, 2, 5, 10, 0]  # (slice id, pos, length, offset) each
    assert errno_of(ns.do, C.CompactChunk, VOL, f, 0, [2, 5, 10, 0, 1, 0, 10, 0], new, 15) == errno.ESTALE
    assert errno_of(ns.do, C.CompactChunk, VOL, f, 0, [1, 2], new, 15) == errno.EINVAL  # not whole records
    # Where the records end, not a size the compactor may have cached.
    assert errno_of(ns.do, C.CompactChunk, VOL, f, 0, records, new, 12) == errno.EINVAL
    ns.do(C.SetAttr, VOL, f, size=12)  # cuts slice 2: the same ids, other records
    assert errno_of(ns.do, C.CompactChunk, VOL, f, 0, records, new, 15) == errno.ESTALE
    ns.do(C.CompactChunk, VOL, f, 0, [1, 0, 10, 0, 2, 5, 7, 0], new, 12)
    assert ns.state.read_chunk(VOL, f, 0) == [(new, 0, 12, 0)]
    assert {r[0] for r in ns.state.trash(VOL, 10)} == {1, 2}
    assert ns.state.usage(VOL, 1).bytes == 12
    ns.check()


def test_rename_rules(ns: Driver) -> None:
    a = ns.mkdir(1, b"a").ino
    b = ns.mkdir(a, b"b").ino
    f = ns.create(1, b"f").ino
    g = ns.create(1, b"g").ino
    rn = ns.do
    assert errno_of(rn, C.Rename, VOL, 1, b"a", b, b"x") == errno.EINVAL  # into own subtree
    assert errno_of(rn, C.Rename, VOL, 1, b"a", a, b"x") == errno.EINVAL
    assert errno_of(rn, C.Rename, VOL, 1, b"nope", 1, b"x") == errno.ENOENT
    assert errno_of(rn, C.Rename, VOL, 1, b"f", 1, b"a") == errno.EISDIR
    assert errno_of(rn, C.Rename, VOL, a, b"b", 1, b"f") == errno.ENOTDIR
    assert errno_of(rn, C.Rename, VOL, 1, b"f", 1, b"g", C.RENAME_NOREPLACE) == errno.EEXIST
    assert errno_of(rn, C.Rename, VOL, 1, b"f", 1, b"zz", C.RENAME_EXCHANGE) == errno.ENOENT
    assert errno_of(rn, C.Rename, VOL, 1, b"f", 1, b"g", 3) == errno.EINVAL
    assert errno_of(rn, C.Rename, VOL, 1, b"f", 1, b"g", 4) == errno.EINVAL
    assert errno_of(rn, C.Rename, VOL, 1, b"f", 1, b"g", 0, "other") == errno.EXDEV
    assert errno_of(rn, C.Rename, VOL, 1, b"f", f, b"x") == errno.ENOTDIR
    ns.mkdir(1, b"c")
    ns.create(b, b"inner")
    assert errno_of(rn, C.Rename, VOL, 1, b"c", 1, b"a") == errno.ENOTEMPTY
    ns.check()
    # over an existing file: the target's inode goes, its name keeps its cookie
    order = [e[0] for e in ns.state.readdir(VOL, 1, 0, 100)]
    rn(C.Rename, VOL, 1, b"f", 1, b"g")
    assert errno_of(ns.state.getattr, VOL, g) == errno.ENOENT
    assert ns.state.lookup(VOL, 1, b"g").ino == f
    assert [e[0] for e in ns.state.readdir(VOL, 1, 0, 100)] == [n for n in order if n != b"f"]
    # across directories, a directory: nlink of both parents follows
    rn(C.Rename, VOL, a, b"b", 1, b"b2")
    assert ns.state.getattr(VOL, a).nlink == 2
    assert ns.state.getattr(VOL, 1).nlink == 5
    assert ns.state.usage(VOL, a).inodes == 0
    # exchange a file and a directory in different parents
    rn(C.Rename, VOL, 1, b"g", b, b"inner", C.RENAME_EXCHANGE)
    assert ns.state.lookup(VOL, b, b"inner").ino == f
    rn(C.Rename, VOL, 1, b"a", 1, b"b2", C.RENAME_EXCHANGE)
    assert ns.state.lookup(VOL, 1, b"a").ino == b
    ns.check()
    # a hard link renamed onto another link of itself: nothing happens
    ns.do(C.Link, VOL, f, 1, b"f2")
    rn(C.Rename, VOL, 1, b"f2", b, b"inner")
    assert ns.state.lookup(VOL, 1, b"f2").ino == f
    ns.check()


def test_readdir_cookies_are_stable_under_change(ns: Driver) -> None:
    d = ns.mkdir(1, b"d").ino
    names = [f"n{i:04}".encode() for i in range(300)]
    for name in names:
        ns.create(d, name)
    seen: list[bytes] = []
    cookie = 0
    removed: set[bytes] = set()
    i = 0
    while True:
        page = ns.state.readdir(VOL, d, cookie, 17)
        if not page:
            break
        seen.extend(e[0] for e in page)
        cookie = page[-1][2]
        # churn between pages: remove some not yet listed, remove some listed, add new ones
        if i < 50:
            for victim in (names[-1 - i], names[i]):
                if victim not in removed:
                    ns.do(C.Unlink, VOL, d, victim)
                    removed.add(victim)
            ns.create(d, f"new{i}".encode())
        i += 1
    stable = [n for n in names if n not in removed]
    assert len(seen) == len(set(seen))
    assert set(stable) <= set(seen)
    assert errno_of(ns.state.readdir, VOL, d, -1, 10) == errno.EINVAL
    assert errno_of(ns.state.readdir, VOL, d, 0, 0) == errno.EINVAL
    f = ns.create(1, b"f").ino
    assert errno_of(ns.state.readdir, VOL, f, 0, 10) == errno.ENOTDIR
    ns.check()


def test_xattrs(ns: Driver) -> None:
    f = ns.create(1, b"f").ino
    ns.do(C.SetXattr, VOL, f, b"user.a", b"1")
    assert ns.state.getxattr(VOL, f, b"user.a") == b"1"
    assert errno_of(ns.do, C.SetXattr, VOL, f, b"user.a", b"2", C.XATTR_CREATE) == errno.EEXIST
    assert errno_of(ns.do, C.SetXattr, VOL, f, b"user.b", b"2", C.XATTR_REPLACE) == errno.ENODATA
    ns.do(C.SetXattr, VOL, f, b"user.a", b"2", C.XATTR_REPLACE)
    ns.do(C.SetXattr, VOL, f, b"user.b", b"", C.XATTR_CREATE)
    assert ns.state.listxattr(VOL, f) == [b"user.a", b"user.b"]
    ns.do(C.RemoveXattr, VOL, f, b"user.a")
    assert errno_of(ns.do, C.RemoveXattr, VOL, f, b"user.a") == errno.ENODATA
    assert errno_of(ns.state.getxattr, VOL, f, b"user.a") == errno.ENODATA
    assert errno_of(ns.do, C.SetXattr, VOL, f, b"x" * 256, b"") == errno.ERANGE
    assert errno_of(ns.do, C.SetXattr, VOL, f, b"", b"") == errno.ERANGE
    assert errno_of(ns.do, C.SetXattr, VOL, f, b"user.c", b"v" * (64 * 1024 + 1)) == errno.ERANGE
    assert errno_of(ns.do, C.SetXattr, VOL, 999, b"user.c", b"") == errno.ENOENT
    ns.check()


def test_quotas(ns: Driver) -> None:
    d = ns.mkdir(1, b"d").ino
    sub = ns.mkdir(d, b"sub").ino
    ns.do(C.SetQuota, VOL, d, 1000, 3)
    f = ns.create(sub, b"f").ino
    ns.write(f, 0, 0, 900)
    assert errno_of(ns.write, f, 0, 900, 200) == errno.EDQUOT
    ns.do(C.SetAttr, VOL, f, size=1 << 40)  # a sparse size stores nothing
    assert ns.state.usage(VOL, d).bytes == 900
    ns.create(d, b"g")
    assert errno_of(ns.create, sub, b"h") == errno.EDQUOT
    assert errno_of(ns.mkdir, d, b"h") == errno.EDQUOT
    assert errno_of(ns.do, C.Link, VOL, f, d, b"f2") == errno.EDQUOT
    ns.create(1, b"outside")
    assert errno_of(ns.do, C.Rename, VOL, 1, b"outside", sub, b"in") == errno.EDQUOT
    ns.do(C.Rename, VOL, sub, b"f", 1, b"moved_out")  # leaving a quota is always fine
    assert ns.state.usage(VOL, d) == Usage(bytes=0, inodes=2, max_bytes=1000, max_inodes=3)
    ns.do(C.Rename, VOL, 1, b"outside", sub, b"in")
    assert errno_of(ns.do, C.SetQuota, VOL, f, 1, 1) == errno.ENOTDIR
    ns.do(C.SetQuota, VOL, d, None, None)
    ns.create(sub, b"h")
    assert ns.state.usage(VOL, 1).inodes == 6
    ns.check()


def test_unlink_stamped_keep_leaves_an_orphan_until_purged(ns: Driver) -> None:
    s1 = ns.do(C.MountVolume, VOL).session
    f = ns.create(1, b"f").ino
    ns.write(f, 0, 0, 10)
    ns.do(C.Unlink, VOL, 1, b"f", f, True)  # the leader stamped: f is open
    a = ns.state.getattr(VOL, f)
    assert a.nlink == 0 and a.size == 10
    assert ns.state.volumes[VOL].orphans == {f}
    assert ns.state.read_chunk(VOL, f, 0) == [(1, 0, 10, 0)]
    assert ns.state.check_open(VOL, f, s1).nlink == 0  # a new session may re-open it
    assert errno_of(ns.do, C.Link, VOL, f, 1, b"back") == errno.ENOENT
    ns.check()
    assert ns.state.trash(VOL, 10) == []
    assert ns.do(C.PurgeOrphans, VOL, [f, 999]) == 1
    assert errno_of(ns.state.getattr, VOL, f) == errno.ENOENT
    assert [r[0] for r in ns.state.trash(VOL, 10)] == [1]
    assert ns.do(C.PurgeOrphans, VOL, [f]) == 0
    ns.do(C.CloseSession, s1)
    assert errno_of(ns.do, C.CloseSession, s1) == errno.ENOENT
    ns.check()


def test_stamps_decide_alike_everywhere(ns: Driver) -> None:
    """Not kept: freed at once. Kept, or a different inode dropped than the
    stamp expected: an orphan. Rename over a target follows the same stamp."""
    f = ns.create(1, b"f").ino
    ns.do(C.Unlink, VOL, 1, b"f", f, False)
    assert errno_of(ns.state.getattr, VOL, f) == errno.ENOENT
    g = ns.create(1, b"g").ino
    ns.do(C.Unlink, VOL, 1, b"g", g + 1000, False)  # predicted another inode: keep
    assert ns.state.volumes[VOL].orphans == {g}
    h = ns.create(1, b"h").ino
    k = ns.create(1, b"k").ino
    ns.do(C.Rename, VOL, 1, b"k", 1, b"h", 0, None, h, True)
    assert ns.state.volumes[VOL].orphans == {g, h}
    assert ns.state.lookup(VOL, 1, b"h").ino == k
    ns.check()
    assert ns.state.predict_drop(VOL, 1, b"h") == k
    assert ns.state.predict_drop(VOL, 1, b"nope") == 0
    blob = ns.state.snapshot()
    copy = MetaState()
    copy.restore(blob)
    assert copy.volumes[VOL].orphans == {g, h}
    # a log entry written before the stamp fields existed still decodes
    old = msgpack.packb([C.Unlink.TAG, ["t", 0, 1, VOL, 1, b"h"]], use_bin_type=True)
    assert C.decode(old) == C.Unlink(VOL, 1, b"h", 0, False, client_id="t", seq=0, now_ns=1)


def test_volumes_and_cluster_map() -> None:
    ns = Driver()
    assert errno_of(ns.do, C.CreateVolume, "a", "ec:4+2", "zstd", 1000, 8) == errno.EINVAL
    assert errno_of(ns.do, C.CreateVolume, "a", "raid5", "zstd", 4 << 20, 8) == errno.EINVAL
    assert errno_of(ns.do, C.CreateVolume, "a b", "ec:4+2", "zstd", 4 << 20, 8) == errno.EINVAL
    assert errno_of(ns.do, C.CreateVolume, "a", "ec:4+2", "lz4", 4 << 20, 8) == errno.EINVAL
    ns.do(C.CreateVolume, "a", "ec:4+2", "zstd", 4 << 20, 8)
    assert errno_of(ns.do, C.CreateVolume, "a", "ec:4+2", "zstd", 4 << 20, 8) == errno.EEXIST
    m = ns.state.cluster.to_dict()
    assert m["volumes"]["a"]["policy"] == "ec:4+2" and m["pgs"]["a"] == []
    for i in range(6):
        ns.do(C.RegisterNode, "datanode", f"dn{i}", f"127.0.0.1:{7000 + i}", f"z{i % 3}", 1 << 30)
    m = ns.state.cluster.to_dict()
    assert len(m["pgs"]["a"]) == 8 and all(len(set(pg)) == 6 for pg in m["pgs"]["a"])
    epoch = m["epoch"]
    ns.do(C.RegisterNode, "datanode", "dn0", "127.0.0.1:7000", "z0", 1 << 30)  # restart: no change
    assert ns.state.cluster.epoch == epoch
    ns.do(C.RegisterNode, "cachenode", "c1", "127.0.0.1:8000", "z0", 1 << 30)
    ns.do(C.RemoveNode, "datanode", "dn5")
    assert ns.state.cluster.to_dict()["pgs"]["a"] == []  # 5 nodes cannot hold ec:4+2
    assert errno_of(ns.do, C.RemoveNode, "datanode", "dn5") == errno.ENOENT
    assert errno_of(ns.do, C.RegisterNode, "tape", "x", "h:1", "z", 1) == errno.EINVAL
    assert errno_of(ns.do, C.RegisterNode, "datanode", "x", "nohost", "z", 1) == errno.EINVAL
    assert ns.do(C.SetVolumeCompression, "a", "none")["compression"] == "none"
    assert ns.state.cluster.to_dict()["volumes"]["a"]["compression"] == "none"
    assert errno_of(ns.do, C.SetVolumeCompression, "zz", "none") == errno.ENOENT
    assert errno_of(ns.do, C.SetVolumeCompression, "a", "lz4") == errno.EINVAL
    st = ns.state.statfs("a")
    assert st.blocks == (5 << 30) * 4 // 6 // st.bsize and st.namemax == 255  # 5 GiB raw, in ec:4+2 bytes
    ns.state.cluster.heartbeat("datanode", "dn1", 123, now=10.0)
    ns.state.cluster.refresh_liveness(now=100.0, timeout=30.0)
    states = {n["id"]: n["state"] for n in ns.state.cluster.to_dict()["datanodes"]}
    assert states["dn1"] == "down"
    ns.check()


def test_a_volume_in_an_object_store_has_no_pgs_and_a_prefix_of_its_own() -> None:
    ns = Driver()
    s3 = {"backing": "s3://bkt/vols/a/", "backing_endpoint": "http://127.0.0.1:9000"}
    for bad in ({"backing": "s3://bkt/no-slash"}, {"backing": "http://bkt/a/"}, {"backing": "s3://B/a/"},
                {"backing_endpoint": "http://127.0.0.1:9000"}, {**s3, "backing_endpoint": "ftp://x"}):
        assert errno_of(ns.do, C.CreateVolume, "a", "replica:1", "none", 4 << 20, 8, **bad) == errno.EINVAL
    assert errno_of(ns.do, C.CreateVolume, "a", "replica:1", "zstd", 4 << 20, 8, **s3) == errno.EINVAL
    for i in range(3):
        ns.do(C.RegisterNode, "datanode", f"dn{i}", f"127.0.0.1:{7000 + i}", f"z{i}", 1 << 20)
    ns.do(C.CreateVolume, "a", "replica:1", "none", 4 << 20, 8, **s3)
    m = ns.state.cluster.to_dict()
    assert m["pgs"]["a"] == [] and m["volumes"]["a"]["backing"] == "s3://bkt/vols/a/"
    assert m["volumes"]["a"]["endpoint"] == "http://127.0.0.1:9000"
    for overlapping in ("s3://bkt/vols/", "s3://bkt/vols/a/b/", "s3://bkt/vols/a/"):
        assert errno_of(ns.do, C.CreateVolume, "b", "replica:1", "none", 4 << 20, 8,
                        **{**s3, "backing": overlapping}) == errno.EEXIST  # fmt: skip
    ns.do(C.CreateVolume, "b", "replica:1", "none", 4 << 20, 8, **{**s3, "backing": "s3://bkt/vols/b/"})
    ns.do(C.CreateVolume, "c", "replica:1", "none", 4 << 20, 8, backing="s3://bkt/vols/a/")  # another store
    assert errno_of(ns.do, C.SetVolumeCompression, "a", "zstd") == errno.EINVAL
    f = ns.do(C.Mknod, "a", 1, b"f", 0o100644, 0, 0, 0)
    sid = ns.do(C.AllocSlices, 1)
    ns.do(C.WriteSlice, "a", f.ino, 0, sid, 0, 60 << 20, 0, 1)  # more than the datanodes hold: not theirs to hold
    assert ns.state.statfs("a").used_bytes == 60 << 20
    for i in range(3):  # none of its volumes needs a datanode
        assert ns.do(C.DrainNode, f"dn{i}", True)["draining"]
    copy = MetaState()
    copy.restore(ns.state.snapshot())
    assert copy.cluster.to_dict()["volumes"] == ns.state.cluster.to_dict()["volumes"]
    ns.check()


def test_enospc_when_the_datanodes_are_full() -> None:
    """Stored bytes times the storage overhead (replica:3) against the
    datanodes' capacity; sizes and shrinking cost nothing."""
    ns = Driver().volume()
    ns.do(C.RegisterNode, "datanode", "dn0", "127.0.0.1:7000", "z", 3000)
    f = ns.create(1, b"f").ino
    ns.write(f, 0, 0, 1000)
    assert errno_of(ns.write, f, 0, 1000, 1) == errno.ENOSPC
    fs = ns.state.statfs(VOL)  # in the volume's bytes
    assert fs.blocks * fs.bsize <= 1000 and fs.bfree == 0 and fs.used_bytes == 1000
    ns.do(C.SetAttr, VOL, f, size=C.MAX_FILE_SIZE)
    ns.do(C.SetAttr, VOL, f, size=0)
    g = ns.create(1, b"g").ino
    ns.write(g, 1000, 0, 1000)  # at 62.5 GiB: what it stores counts, not where
    assert ns.state.getattr(VOL, g).size == 1000 * CHUNK_SIZE + 1000
    assert ns.state.usage(VOL, 1).bytes == 1000
    ns.check()


def test_usage_counts_stored_bytes() -> None:
    ns = Driver().volume()
    d = ns.mkdir(1, b"d").ino
    f = ns.create(d, b"f").ino
    ns.write(f, 0, 0, 100)
    ns.write(f, 0, 50, 100)  # overlaps: both slices are still stored
    assert ns.state.usage(VOL, d).bytes == 200
    ns.write(f, 0, 0, 200)  # covers both: they go to the trash
    assert ns.state.usage(VOL, d).bytes == 200
    ns.write(f, 3, 0, 10)
    ns.do(C.SetAttr, VOL, f, size=50)  # the chunk-3 record goes, the first is cut but stored
    assert ns.state.usage(VOL, d).bytes == 200
    ns.do(C.Link, VOL, f, 1, b"f2")  # every link counts
    assert ns.state.usage(VOL, 1).bytes == 400 and ns.state.volumes[VOL].used_bytes == 200
    ns.do(C.Symlink, VOL, d, b"s", b"x" * 100, 0, 0)  # stores no slice
    assert ns.state.usage(VOL, d).bytes == 200
    ns.check()
    # A snapshot of version 4 counted logical sizes: loading recounts.
    raw = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(ns.state.snapshot()), raw=False,
                          strict_map_key=False)  # fmt: skip
    raw[0] = 4
    raw[4][0][2] = 12345  # used_bytes, as an old leader counted it
    copy = MetaState()
    copy.restore(zstandard.ZstdCompressor().compress(msgpack.packb(raw, use_bin_type=True)))
    assert copy.volumes[VOL].used_bytes == 200 and copy.usage(VOL, 1).bytes == 400
    check(copy)


def test_dedup_returns_the_first_answer_and_survives_snapshots(ns: Driver) -> None:
    cmd = C.Mknod(VOL, 1, b"f", 0o644, 0, 0, 0, client_id="client-a", seq=7, now_ns=1).encode()
    first = ns.state.apply(100, cmd)
    assert ns.state.apply(101, cmd) == first  # applied once
    again = MetaState()
    again.restore(ns.state.snapshot())
    assert again.apply(102, cmd) == list(first)  # restored answers are their wire form
    failing = C.Mknod(VOL, 1, b"f", 0o644, 0, 0, 0, client_id="client-a", seq=8, now_ns=1).encode()
    err = again.apply(103, failing)
    assert isinstance(err, Failure) and err.code == "EEXIST"
    again.apply(104, C.Unlink(VOL, 1, b"f", client_id="client-a", seq=9, now_ns=1).encode())
    assert again.apply(105, failing) == err  # the first answer, though it would succeed now
    for seq in range(10, 10 + DEDUP_WINDOW + 5):
        again.apply(200 + seq, C.AllocSlices(1, client_id="client-a", seq=seq, now_ns=1).encode())
    too_old = again.apply(9999, C.Mknod(VOL, 1, b"g", 0o644, 0, 0, 0, client_id="client-a", seq=9, now_ns=1).encode())
    assert isinstance(too_old, Failure) and too_old.code == "EINVAL"
    with pytest.raises(CacheFSError):
        again.lookup(VOL, 1, b"g")


def test_snapshot_round_trip_is_exact(ns: Driver) -> None:
    s = ns.do(C.MountVolume, VOL).session
    d = ns.mkdir(1, b"d").ino
    f = ns.create(d, b"f").ino
    for i in range(100):
        ns.write(f, i % 3, i, 10)
    ns.do(C.Link, VOL, f, 1, b"f-link")
    ns.do(C.Symlink, VOL, d, b"s", b"f", 0, 0)
    ns.do(C.SetXattr, VOL, f, b"user.k", b"v")
    ns.do(C.SetQuota, VOL, d, 1 << 40, 1000)
    g = ns.create(1, b"g").ino
    ns.write(g, 0, 0, 5)
    assert s
    ns.do(C.Unlink, VOL, 1, b"g", g, True)
    ns.do(C.RegisterNode, "datanode", "dn0", "127.0.0.1:7000", "z", 1 << 30)
    ns.check()
    blob = ns.state.snapshot()
    copy = MetaState()
    copy.restore(blob)
    assert copy.snapshot() == blob
    for vol in ns.state.volumes:
        for ino in ns.state.volumes[vol].inodes:
            assert copy.getattr(vol, ino) == ns.state.getattr(vol, ino)
    assert copy.readdir(VOL, 1, 0, 100) == ns.state.readdir(VOL, 1, 0, 100)
    assert copy.read_chunk(VOL, f, 1) == ns.state.read_chunk(VOL, f, 1)
    Driver(copy).check()
    # both continue identically
    cmd = C.Mknod(VOL, d, b"new", 0o644, 0, 0, 0, client_id="x", seq=1, now_ns=5).encode()
    assert copy.apply(5000, cmd) == ns.state.apply(5000, cmd)
    assert copy.snapshot() == ns.state.snapshot()


def test_silent_clients_are_forgotten_deterministically(ns: Driver) -> None:
    minute = 60 * 10**9
    old = C.Mknod(VOL, 1, b"a", 0o644, 0, 0, 0, client_id="gone", seq=1, now_ns=1 * minute).encode()
    first = ns.state.apply(10, old)
    ns.state.apply(11, C.Mknod(VOL, 1, b"b", 0o644, 0, 0, 0, client_id="busy", seq=1, now_ns=5 * minute).encode())
    assert ns.state.apply(12, old) == first  # still remembered after 4 minutes
    ns.state.apply(13, C.Mknod(VOL, 1, b"c", 0o644, 0, 0, 0, client_id="busy", seq=2, now_ns=12 * minute).encode())
    assert "gone" not in ns.state.dedup and "busy" in ns.state.dedup
    copy = MetaState()
    copy.restore(ns.state.snapshot())
    assert copy.snapshot() == ns.state.snapshot()
    assert copy.dedup_swept_ns == 12 * minute


def test_remaining_error_cases(ns: Driver) -> None:
    st = ns.state
    f = ns.create(1, b"f").ino
    d = ns.mkdir(1, b"d").ino
    s = ns.do(C.Symlink, VOL, 1, b"s", b"f", 0, 0).ino
    fifo = ns.create(1, b"p", stat.S_IFIFO | 0o644).ino
    session = ns.do(C.MountVolume, VOL).session
    assert errno_of(st.statfs, "nope") == errno.ENOENT
    assert errno_of(st.listxattr, VOL, 999) == errno.ENOENT
    assert errno_of(st.getxattr, VOL, 999, b"user.a") == errno.ENOENT
    assert errno_of(st.readlink, VOL, 999) == errno.ENOENT
    assert errno_of(st.read_chunk, VOL, 999, 0) == errno.ENOENT
    assert errno_of(st.read_chunk, VOL, s, 0) == errno.EINVAL
    assert errno_of(st.read_chunk, VOL, f, -1) == errno.EINVAL
    assert errno_of(st.usage, VOL, f) == errno.ENOTDIR
    assert errno_of(st.trash, "nope", 10) == errno.ENOENT
    assert errno_of(st.check_open, VOL, d, session) == errno.EISDIR
    assert errno_of(st.check_open, VOL, fifo, session) == errno.EINVAL
    assert errno_of(st.check_open, VOL, 999, session) == errno.ENOENT
    assert errno_of(st.check_open, VOL, f, "no-such-session") == errno.ENOENT
    assert errno_of(ns.do, C.MountVolume, "nope") == errno.ENOENT
    assert errno_of(ns.do, C.AllocSlices, 0) == errno.EINVAL
    assert errno_of(ns.do, C.AllocSlices, C.MAX_SLICE_ALLOC + 1) == errno.EINVAL
    assert errno_of(ns.do, C.PurgeTrash, "nope", [1]) == errno.ENOENT
    new = ns.do(C.AllocSlices, 1)
    assert errno_of(ns.do, C.CompactChunk, VOL, d, 0, [1], new, 10) == errno.EINVAL
    assert errno_of(ns.do, C.CompactChunk, VOL, f, 0, [1], new + 5, 10) == errno.EINVAL
    assert errno_of(ns.do, C.CompactChunk, VOL, f, 0, [], new, 10) == errno.EINVAL
    assert errno_of(ns.do, C.WriteSlice, VOL, s, 0, new, 0, 1, 0, 0) == errno.EINVAL
    assert errno_of(ns.do, C.SetQuota, VOL, 999, 1, 1) == errno.ENOENT
    assert errno_of(ns.do, C.SetQuota, VOL, d, -1, None) == errno.EINVAL
    assert errno_of(ns.do, C.Mkdir, VOL, 1, b"x", stat.S_IFREG | 0o755, 0, 0) == errno.EINVAL
    assert errno_of(ns.do, C.Unlink, VOL, 1, b"nope") == errno.ENOENT
    assert errno_of(ns.do, C.Unlink, VOL, f, b"x") == errno.ENOTDIR
    assert errno_of(ns.do, C.Rename, VOL, f, b"x", 1, b"y") == errno.ENOTDIR
    assert errno_of(ns.do, C.Rename, VOL, 1, b"f", 999, b"y") == errno.ENOENT
    assert errno_of(ns.do, C.Link, VOL, f, 1, b"x" * 256) == errno.ENAMETOOLONG
    assert errno_of(ns.do, C.Rename, VOL, 1, b"f", 1, b"y" * 256) == errno.ENAMETOOLONG
    assert errno_of(ns.do, C.Mknod, "nope", 1, b"x", 0o644, 0, 0, 0) == errno.ENOENT
    ns.check()


def test_short_blocks_queue_with_their_commit_until_repaired_or_purged(ns: Driver) -> None:
    f = ns.create(1, b"f").ino
    s1, s2, s3 = (ns.do(C.AllocSlices, 1) for _ in range(3))
    ns.do(C.WriteSlice, VOL, f, 0, s1, 0, 9 << 20, 0, 1, short=(2, 0))
    ns.do(C.WriteSlice, VOL, f, 1, s2, 0, 100, 0, 1)  # stored whole: nothing queued
    ns.do(C.WriteSlice, VOL, f, 2, s3, 0, 100, 0, 1, short=(0,))
    assert [e[:2] for e in ns.state.repair_queue(VOL, 10)] == [(s1, 2), (s1, 0), (s3, 0)]  # oldest first
    assert ns.do(C.RepairsDone, VOL, (s1, 2, s1, 7)) == 1  # (s1, 7) was never queued
    blob = ns.state.snapshot()
    copy = MetaState()
    copy.restore(blob)
    assert copy.repair_queue(VOL, 10) == ns.state.repair_queue(VOL, 10) and copy.snapshot() == blob
    ns.do(C.SetAttr, VOL, f, size=0)  # every slice to the trash...
    assert len(ns.state.repair_queue(VOL, 10)) == 2
    ns.do(C.PurgeTrash, VOL, [s1])  # ...and s1's blocks deleted: nothing left to repair there
    assert [e[:2] for e in ns.state.repair_queue(VOL, 10)] == [(s3, 0)]
    ns.check()
    for bad in [(1, 1), (-1,), (C.MAX_SLICE_BLOCKS,)]:
        assert errno_of(ns.do, C.WriteSlice, VOL, f, 0, s1, 0, 10, 0, 1, short=bad) == errno.EINVAL
    assert errno_of(ns.do, C.RepairsDone, VOL, (s3,)) == errno.EINVAL
    assert "repairs_done" not in C.REQUESTS  # the leader's own: no client can send it


def test_snapshots_without_a_repair_queue_still_load(ns: Driver) -> None:
    f = ns.create(1, b"f").ino
    ns.write(f, 0, 0, 10)
    parts = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(ns.state.snapshot()), raw=False,
                            strict_map_key=False)
    for vol in parts[4]:
        del vol[8:]  # as written before the repair queue existed
    old = zstandard.ZstdCompressor().compress(msgpack.packb(parts, use_bin_type=True))
    copy = MetaState()
    copy.restore(old)
    assert copy.repair_queue(VOL, 10) == [] and copy.read_chunk(VOL, f, 0) == ns.state.read_chunk(VOL, f, 0)


def test_sealed_slices_cannot_be_committed_and_unreferenced_ones_are_leaks(ns: Driver) -> None:
    f = ns.create(1, b"f").ino
    g = ns.create(1, b"g").ino
    held, trashed, leaked, orphaned = (ns.do(C.AllocSlices, 1) for _ in range(4))
    ns.do(C.WriteSlice, VOL, f, 0, held, 0, 100, 0, 1)
    ns.do(C.WriteSlice, VOL, f, 1, trashed, 0, 100, 0, 1)
    ns.do(C.SetAttr, VOL, f, size=CHUNK_SIZE)  # chunk 1 to the trash
    ns.do(C.WriteSlice, VOL, g, 0, orphaned, 0, 100, 0, 1)
    ns.do(C.Unlink, VOL, 1, b"g", g, True)  # open: an orphan keeps its slices
    late = ns.do(C.AllocSlices, 1)  # allocated, not yet sealed
    ids = (held, trashed, leaked, orphaned, late)
    assert ns.state.unreferenced(VOL, ids) == (0, [])  # nothing sealed: nothing is a leak yet
    assert ns.do(C.SealSlices, late) == late
    assert ns.state.unreferenced(VOL, ids) == (late, [leaked])
    assert errno_of(ns.do, C.WriteSlice, VOL, f, 2, leaked, 0, 100, 0, 1) == errno.EIO
    with pytest.raises(SliceExpired):  # a writer that held it too long stores it again
        ns.do(C.WriteSlice, VOL, f, 2, leaked, 0, 100, 0, 1)
    with pytest.raises(SliceExpired):
        ns.do(C.CompactChunk, VOL, f, 0, (held, 0, 100, 0), leaked, 100)
    assert ns.state.unreferenced(VOL, ids) == (late, [leaked])  # the refused commits changed nothing
    ns.do(C.WriteSlice, VOL, f, 2, late, 0, 100, 0, 1)  # at the floor: still fine
    assert ns.do(C.SealSlices, 1) == late  # the floor never goes down...
    assert ns.do(C.SealSlices, 1 << 40) == ns.state.next_slice  # ...nor past the next id
    blob = ns.state.snapshot()
    copy = MetaState()
    copy.restore(blob)
    assert copy.slice_floor == ns.state.next_slice and copy.snapshot() == blob
    parts = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(blob), raw=False, strict_map_key=False)
    old = zstandard.ZstdCompressor().compress(msgpack.packb(parts[:8], use_bin_type=True))
    copy.restore(old)  # as written before the floor existed
    assert copy.slice_floor == 0 and copy.unreferenced(VOL, ids) == (0, [])
    assert errno_of(ns.state.unreferenced, "nope", ids) == errno.ENOENT
    ns.check()


def test_fallocate_is_a_slice_list_change() -> None:
    ns = Driver().volume()
    d = ns.mkdir(1, b"d").ino
    f = ns.create(d, b"f").ino
    ns.write(f, 0, 0, 100)
    ns.write(f, 2, 0, 100)
    ns.do(C.SetQuota, VOL, d, 1000, None)
    assert errno_of(ns.do, C.Fallocate, VOL, f, 0, 0, 1000) == errno.EDQUOT  # no room for it
    a = ns.do(C.Fallocate, VOL, f, C.FALLOC_FL_KEEP_SIZE, 0, 800)
    assert a.size == 2 * CHUNK_SIZE + 100 and ns.state.usage(VOL, d).bytes == 200  # nothing charged
    # A hole over chunks 0..2: a hole record where records are, the wholly covered slice goes.
    hole = C.FALLOC_FL_PUNCH_HOLE | C.FALLOC_FL_KEEP_SIZE
    b = ns.do(C.Fallocate, VOL, f, hole, 50, 3 * CHUNK_SIZE)
    assert b.size == a.size and b.version > a.version
    assert ns.state.read_chunk(VOL, f, 0) == [(1, 0, 100, 0), (0, 50, CHUNK_SIZE - 50, 0)]
    assert ns.state.read_chunk(VOL, f, 1) == []
    assert ns.state.read_chunk(VOL, f, 2) == [(0, 0, 100, 0)]  # clipped at the size
    assert ns.state.usage(VOL, d).bytes == 100 and [r[0] for r in ns.state.trash(VOL, 10)] == [2]
    c = ns.do(C.Fallocate, VOL, f, C.FALLOC_FL_ZERO_RANGE, 3 * CHUNK_SIZE, 10)
    assert c.size == 3 * CHUNK_SIZE + 10
    for mode in (0x08, 0x20, 0x02, 0x40):  # collapse, insert, punch without KEEP_SIZE, unshare
        assert errno_of(ns.do, C.Fallocate, VOL, f, mode, 0, 10) == errno.EOPNOTSUPP
    assert errno_of(ns.do, C.Fallocate, VOL, f, 0, C.MAX_FILE_SIZE, 1) == errno.EFBIG
    assert errno_of(ns.do, C.Fallocate, VOL, d, 0, 0, 1) == errno.EISDIR
    ns.check()
    copy = MetaState()
    copy.restore(ns.state.snapshot())
    check(copy)
