"""Data repository links in the namespace state machine: LinkRepo, ImportObjects, UnlinkRepo, RepoObject."""

from __future__ import annotations

import errno

import msgpack
import pytest

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError
from cachefs.ids import CHUNK_SIZE, is_repo_slice
from cachefs.metanode.namespace import MetaState

from .nsdriver import VOL, Driver


def errno_of(fn, *args) -> int:
    with pytest.raises(CacheFSError) as info:
        fn(*args)
    return info.value.errno


def rows(*objs: tuple[str, int, str]) -> bytes:
    return msgpack.packb([[key, size, 7_000 + i, etag] for i, (key, size, etag) in enumerate(objs)])


@pytest.fixture
def ns() -> Driver:
    return Driver().volume()


def linked(ns: Driver) -> tuple[int, int]:
    d = ns.mkdir(1, b"data")
    link = ns.do(C.LinkRepo, VOL, d.ino, "bkt", "pre/", "http://127.0.0.1:9000")
    return link["id"], d.ino


def path(ns: Driver, ino: int, *names: bytes):
    attr = None
    for name in names:
        attr = ns.state.lookup(VOL, ino, name)
        ino = attr.ino
    return attr


def test_import_makes_files_whose_blocks_are_repo_slices(ns: Driver) -> None:
    link, d = linked(ns)
    big = 2 * CHUNK_SIZE + 3
    got = ns.do(C.ImportObjects, link, rows(("a.bin", 10, '"e1"'), ("x/y/b.bin", big, '"e2"'), ("p//q", 1, '"e3"'),
                                           ("empty", 0, '"e4"')), cursor="x/y/b.bin")  # fmt: skip
    assert got == {"created": 3, "updated": 0, "unchanged": 0, "skipped": 1, "deleted": 0}  # "p//q" names no file
    b = path(ns, d, b"x", b"y", b"b.bin")
    assert b.size == big and b.mtime_ns == 7_001
    chunks = [ns.state.read_chunk(VOL, b.ino, c) for c in range(3)]
    (sid,) = {rec[0] for recs in chunks for rec in recs}
    assert is_repo_slice(sid)
    # one object: chunk c holds its bytes [c*CHUNK, ...), so block i is object bytes [i*bs, ...)
    assert [recs for recs in chunks] == [[(sid, 0, CHUNK_SIZE, 0)], [(sid, 0, CHUNK_SIZE, CHUNK_SIZE)],
                                         [(sid, 0, 3, 2 * CHUNK_SIZE)]]  # fmt: skip
    assert Q.RepoObject(VOL, sid).run(ns.state) == {
        "link": ns.state.repo_links()[0], "key": "pre/x/y/b.bin", "etag": '"e2"', "size": big,
        "block_size": 4 << 20}  # fmt: skip
    assert ns.state.statfs(VOL).used_bytes == 0  # the bytes are in the bucket, not on the datanodes
    assert b.blocks == (big + 4095) // 4096 * 8  # but du counts them, as stored (in the bucket)
    ns.do(C.SetAttr, VOL, b.ino, None, None, None, CHUNK_SIZE + 1)  # a cut record counts what it reads
    assert path(ns, d, b"x", b"y", b"b.bin").blocks == (CHUNK_SIZE + 4096) // 4096 * 8
    assert ns.state.repo_pending(link) == {"": "x/y/b.bin"} and ns.state.repo_links()[0]["objects"] == 3
    ns.check()


def test_a_changed_etag_is_a_new_version_with_new_block_keys(ns: Driver) -> None:
    link, d = linked(ns)
    ns.do(C.ImportObjects, link, rows(("a", 10, '"v1"'), ("b", 5, '"w"')))
    a1 = path(ns, d, b"a")
    (old,) = {r[0] for r in ns.state.read_chunk(VOL, a1.ino, 0)}
    got = ns.do(C.ImportObjects, link, rows(("a", 12, '"v2"'), ("b", 5, '"w"')), done=True)
    assert got == {"created": 0, "updated": 1, "unchanged": 1, "skipped": 0, "deleted": 0}
    a2 = path(ns, d, b"a")
    (new,) = {r[0] for r in ns.state.read_chunk(VOL, a2.ino, 0)}
    assert a2.ino == a1.ino and a2.version > a1.version and a2.size == 12 and new != old
    assert errno_of(Q.RepoObject(VOL, old).run, ns.state) == errno.ENOENT  # the old version reads nothing
    assert ns.state.repo_links()[0]["imported_ns"] > 0
    assert ns.state.trash(VOL, 100) == []  # no datanode blocks to delete
    ns.check()


def test_local_files_and_directories_win_over_objects(ns: Driver) -> None:
    link, d = linked(ns)
    local = ns.create(d, b"mine")
    ns.write(local.ino, 0, 0, 100)
    ns.mkdir(d, b"adir")
    ns.do(C.ImportObjects, link, rows(("w", 10, '"1"')))
    w = path(ns, d, b"w")
    ns.write(w.ino, 0, 0, 4)  # written through the mount: now local
    got = ns.do(C.ImportObjects, link, rows(("mine", 1, '"x"'), ("adir", 1, '"x"'), ("mine/sub", 1, '"x"'),
                                           ("w", 10, '"2"')))  # fmt: skip
    assert got == {"created": 0, "updated": 0, "unchanged": 0, "skipped": 4, "deleted": 0}
    assert path(ns, d, b"mine").size == 100
    ns.check()


def test_removing_an_imported_file_forgets_its_object(ns: Driver) -> None:
    link, d = linked(ns)
    ns.do(C.ImportObjects, link, rows(("a", 10, '"1"')))
    sid = ns.state.read_chunk(VOL, path(ns, d, b"a").ino, 0)[0][0]
    ns.do(C.Unlink, VOL, d, b"a")
    assert ns.state.repo_objects == {} and ns.state.trash(VOL, 100) == []
    assert errno_of(Q.RepoObject(VOL, sid).run, ns.state) == errno.ENOENT


def test_links_do_not_nest_and_unlink_forgets(ns: Driver) -> None:
    link, d = linked(ns)
    sub = ns.mkdir(d, b"sub")
    assert errno_of(ns.do, C.LinkRepo, VOL, sub.ino, "bkt", "") == errno.EEXIST
    assert errno_of(ns.do, C.LinkRepo, VOL, 1, "bkt", "") == errno.EEXIST
    assert errno_of(ns.do, C.LinkRepo, VOL, 999, "bkt", "") == errno.ENOENT
    ns.do(C.ImportObjects, link, rows(("a", 10, '"1"')))
    sid = ns.state.read_chunk(VOL, path(ns, d, b"a").ino, 0)[0][0]
    assert ns.do(C.UnlinkRepo, link)["id"] == link
    assert ns.state.repo_links() == []
    with pytest.raises(CacheFSError, match=f"repository link {link} was removed"):
        Q.RepoObject(VOL, sid).run(ns.state)
    assert errno_of(ns.do, C.ImportObjects, link, rows()) == errno.ENOENT
    assert errno_of(ns.do, C.UnlinkRepo, link) == errno.ENOENT


def test_bad_requests_are_refused_naming_the_field() -> None:
    with pytest.raises(CacheFSError, match="bucket name"):
        C.LinkRepo(VOL, 1, "B!", "")
    with pytest.raises(CacheFSError, match="endpoint"):
        C.LinkRepo(VOL, 1, "bkt", "", "ftp://x")
    with pytest.raises(CacheFSError, match="import mode"):
        C.LinkRepo(VOL, 1, "bkt", "", "", "", "sometimes")
    with pytest.raises(CacheFSError, match="import entry"):
        C.ImportObjects(1, msgpack.packb([["k", 1]]))
    with pytest.raises(CacheFSError, match="size of 'k'"):
        C.ImportObjects(1, msgpack.packb([["k", -1, 0, "e"]]))
    with pytest.raises(CacheFSError, match="undecodable"):
        C.ImportObjects(1, b"\xc1")
    with pytest.raises(CacheFSError, match="slice_id"):
        Q.RepoObject(VOL, 5)  # not a repo slice


def test_links_and_objects_survive_a_snapshot(ns: Driver) -> None:
    link, d = linked(ns)
    ns.do(C.ImportObjects, link, rows(("a", 10, '"1"'), ("e", 0, '"0"')), cursor="e",
          subdirs=msgpack.packb(["b/"]))  # fmt: skip
    ns.do(C.ImportObjects, link, rows(("b/c", 3, '"2"')), dir="b/", cursor="b/c")
    blob = ns.state.snapshot()
    other = MetaState()
    other.restore(blob)
    assert other.snapshot() == blob
    assert other.repo_links() == ns.state.repo_links()
    assert other.repo_pending(link) == {"": "e", "b/": "b/c"}
    assert other.links[link].empties == {other.lookup(VOL, d, b"e").ino}
    sid = other.read_chunk(VOL, other.lookup(VOL, d, b"a").ino, 0)[0][0]
    assert other.repo_object(VOL, sid)["key"] == "pre/a"
    again = Driver(other, client="after-restore")
    again.index = ns.index
    again.do(C.ImportObjects, link, rows(("new", 1, '"3"')))  # counters went on
    assert other.read_chunk(VOL, other.lookup(VOL, d, b"new").ino, 0)[0][0] > sid


def test_an_import_names_what_it_changes_so_leases_on_it_are_revoked(ns: Driver) -> None:
    link, d = linked(ns)
    ns.do(C.ImportObjects, link, rows(("x/a", 10, '"1"')))
    x = path(ns, d, b"x")
    a = path(ns, d, b"x", b"a")
    change = C.ImportObjects(link, rows(("x/a", 10, '"2"'), ("x/new", 1, '"3"'), ("y/b", 1, '"4"')))
    assert ns.state.touched(change) == (VOL, {d, x.ino, a.ino})
    assert ns.state.touched(C.ImportObjects(99, rows())) is None  # no such link: nothing to revoke


def page(ns: Driver, link: int, *objs: tuple[str, int, str], subdirs: tuple[str, ...] = (), done: bool = True,
         **kw: str) -> dict[str, int]:  # fmt: skip
    """One pruning page of a delimited listing (``dir``, ``after``, ``cursor`` in ``kw``)."""
    return ns.do(C.ImportObjects, link, rows(*objs), done=done, subdirs=msgpack.packb(list(subdirs)), prune=True, **kw)


def test_directories_of_a_listing_are_pending_until_listed_to_the_end(ns: Driver) -> None:
    link, d = linked(ns)
    assert ns.state.repo_pending(link) == {"": ""}
    got = page(ns, link, ("a", 1, '"1"'), subdirs=("s/", "t/"), cursor="t/", done=False)
    assert got["created"] == 1 and ns.state.repo_pending(link) == {"": "t/", "s/": "", "t/": ""}
    assert path(ns, d, b"s").mode & 0o040000
    page(ns, link, ("u", 1, '"2"'), after="t/")
    page(ns, link, ("s/x", 1, '"3"'), dir="s/", subdirs=("s/deep/",))
    assert ns.state.repo_pending(link) == {"t/": "", "s/deep/": ""} and not ns.state.repo_links()[0]["imported_ns"]
    page(ns, link, dir="t/")
    page(ns, link, dir="s/deep/")
    assert ns.state.repo_pending(link) == {} and ns.state.repo_links()[0]["imported_ns"] > 0
    page(ns, link, ("a", 1, '"1"'), ("u", 1, '"2"'), subdirs=("s/", "t/"))  # a sync: listed dirs stay listed
    assert ns.state.repo_pending(link) == {}
    ns.check()


def test_a_pruning_page_removes_what_the_bucket_no_longer_lists(ns: Driver) -> None:
    link, d = linked(ns)
    page(ns, link, ("a", 1, '"1"'), ("b", 2, '"2"'), ("c", 3, '"3"'), ("e", 0, '"e"'), subdirs=("s/", "t/"))
    page(ns, link, ("s/x", 4, '"4"'), dir="s/")
    page(ns, link, ("t/y", 5, '"5"'), dir="t/")
    mine = ns.create(d, b"mine")  # local files: never the bucket's to delete
    ns.write(mine.ino, 0, 0, 10)
    kept = ns.create(path(ns, d, b"t").ino, b"kept")
    empty_local = ns.create(d, b"empty-local")
    b = path(ns, d, b"b")
    b_sid = ns.state.read_chunk(VOL, b.ino, 0)[0][0]
    assert ns.state.links[link].objects == 6

    # a page of names (a, c]: only b goes, and the key after it is not spoken for
    got = page(ns, link, ("c", 3, '"3"'), after="a", cursor="c", done=False)
    assert got["deleted"] == 1 and got["unchanged"] == 1
    assert errno_of(ns.state.lookup, VOL, d, b"b") == errno.ENOENT
    assert b.ino in ns.state.volumes[VOL].orphans  # it may be open: the leader purges it if not
    assert Q.RepoObject(VOL, b_sid).run(ns.state)["key"] == "pre/b"  # an open file still reads its blocks
    # the last page of the listing: e (an empty object), s/ and t/ are gone from the bucket
    got = page(ns, link, ("d", 1, '"d"'), after="c")
    assert got == {"created": 1, "updated": 0, "unchanged": 0, "skipped": 0, "deleted": 3}
    names = {e.name for e in ns.state.readdir(VOL, d, 0, 100)}
    assert names == {b"a", b"c", b"d", b"t", b"mine", b"empty-local"}  # t holds a local file
    assert {e.name for e in ns.state.readdir(VOL, path(ns, d, b"t").ino, 0, 100)} == {b"kept"}
    assert path(ns, d, b"t", b"kept").ino == kept.ino and path(ns, d, b"empty-local").ino == empty_local.ino
    assert ns.state.links[link].objects == 3
    ns.do(C.PurgeOrphans, VOL, tuple(sorted(ns.state.volumes[VOL].orphans)))
    assert errno_of(Q.RepoObject(VOL, b_sid).run, ns.state) == errno.ENOENT
    ns.check()


def test_a_pruning_page_names_what_it_removes_for_the_leases(ns: Driver) -> None:
    link, d = linked(ns)
    page(ns, link, ("a", 1, '"1"'), subdirs=("s/",))
    page(ns, link, ("s/x", 4, '"4"'), dir="s/")
    s, x = path(ns, d, b"s"), path(ns, d, b"s", b"x")
    _, inos = ns.state.touched(C.ImportObjects(link, rows(), done=True, prune=True))
    assert inos == {d, path(ns, d, b"a").ino, s.ino, x.ino}


def test_pending_directories_of_a_lazy_link_are_indexed_and_survive_a_snapshot(ns: Driver) -> None:
    d = ns.mkdir(1, b"lazy")
    link = ns.do(C.LinkRepo, VOL, d.ino, "bkt", "", "", "", "lazy")["id"]
    assert ns.state.lazy_dirs == {(VOL, d.ino): (link, "")}
    page(ns, link, ("a", 1, '"1"'), subdirs=("s/", "t/"))
    s, t = path(ns, d.ino, b"s"), path(ns, d.ino, b"t")
    assert ns.state.lazy_dirs == {(VOL, s.ino): (link, "s/"), (VOL, t.ino): (link, "t/")}
    page(ns, link, ("s/x", 1, '"2"'), dir="s/", subdirs=("s/u/",))
    u = path(ns, s.ino, b"u")
    other = MetaState()
    other.restore(ns.state.snapshot())
    assert other.lazy_dirs == ns.state.lazy_dirs == {(VOL, t.ino): (link, "t/"), (VOL, u.ino): (link, "s/u/")}
    page(ns, link, ("a", 1, '"1"'), subdirs=("s/",))  # t/ went from the bucket
    assert ns.state.lazy_dirs == {(VOL, u.ino): (link, "s/u/")}
    full = ns.mkdir(1, b"full")
    ns.do(C.LinkRepo, VOL, full.ino, "bkt", "")
    assert len(ns.state.lazy_dirs) == 1  # a full link's pending directories are its importer's
    ns.do(C.UnlinkRepo, link)
    assert ns.state.lazy_dirs == {}


def test_a_page_naming_a_key_twice_imports_it_once(ns: Driver) -> None:
    link, d = linked(ns)
    got = page(ns, link, ("a", 1, '"1"'), ("a", 2, '"2"'), ("b", 3, '"3"'))
    assert (got["created"], got["skipped"]) == (2, 1) and path(ns, d, b"a").size == 1
    ns.check()
