"""The export queue of repository links in the state machine (metanode/exports.py)."""

from __future__ import annotations

import msgpack
import pytest

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import Busy, InvalidArgument, Stale
from cachefs.ids import is_repo_slice
from cachefs.metanode.exports import CREATED_WAIT_NS
from cachefs.metanode.namespace import MetaState

from .nsdriver import VOL, Driver


@pytest.fixture
def ns() -> Driver:
    return Driver().volume()


def linked(ns: Driver, auto_export: str = "new,changed,deleted") -> tuple[int, int]:
    d = ns.mkdir(1, b"data")
    link = ns.do(C.LinkRepo, VOL, d.ino, "bkt", "pre/", "http://127.0.0.1:9000", auto_export=auto_export)
    return link["id"], d.ino


def queue(ns: Driver, link: int) -> dict:
    return Q.RepoExports(link).run(ns.state)


def test_auto_export_takes_only_the_named_events() -> None:
    assert C.parse_auto_export("deleted, new") == "new,deleted"
    assert C.parse_auto_export("") == ""
    with pytest.raises(InvalidArgument, match="renamed"):
        C.parse_auto_export("new,renamed")
    with pytest.raises(InvalidArgument, match="canonical"):
        C.LinkRepo(VOL, 2, "bkt", "", auto_export="deleted,new")


def test_a_written_file_is_queued_by_the_write_that_commits_it(ns: Driver) -> None:
    link, d = linked(ns)
    sub = ns.mkdir(d, b"sub")
    f = ns.create(sub.ino, b"a.bin")
    outside = ns.create(1, b"not-linked")
    ns.write(outside.ino, 0, 0, 10)
    assert [(p[0], p[1], p[3]) for p in queue(ns, link)["puts"]] == [(f.ino, "pre/sub/a.bin", "created")]
    created = ns.state.links[link].puts[f.ino][4]
    assert ns.state.repo_exports(link, 10, created + 1)["puts"] == []  # waits for the write that follows
    assert len(ns.state.repo_exports(link, 10, created + CREATED_WAIT_NS)["puts"]) == 1  # or goes empty
    gen = queue(ns, link)["puts"][0][2]
    ns.write(f.ino, 0, 0, 100)  # written during its export: a newer gen
    (put,) = queue(ns, link)["puts"]
    assert put[2] > gen and put[3] == "new"
    assert ns.state.repo_exports(link, 10, created + 1)["puts"] != []  # written: due at once
    assert ns.do(C.ExportDone, link, f.ino, put[1], gen) == {"applied": False}  # the old upload: stays queued
    assert queue(ns, link)["pending"] == 1
    assert ns.do(C.ExportDone, link, f.ino, put[1], put[2]) == {"applied": True}
    q = queue(ns, link)
    assert (q["puts"], q["pending"], q["done"]) == ([], 0, 1)
    ns.check()


def test_an_imported_file_written_is_changed_and_a_deleted_name_is_a_delete(ns: Driver) -> None:
    link, d = linked(ns, "changed,deleted")
    ns.do(C.ImportObjects, link, msgpack.packb([["img.jpg", 10, 7, '"e1"']]), done=True)
    img = ns.state.lookup(VOL, d, b"img.jpg")
    assert queue(ns, link)["puts"] == []  # imports are the bucket's own content
    new = ns.create(d, b"local.txt")
    ns.write(new.ino, 0, 0, 5)
    assert queue(ns, link)["puts"] == []  # "new" is not exported by this link
    ns.write(img.ino, 0, 0, 3)
    ns.write(img.ino, 0, 3, 3)  # a second write: still a change of the bucket's object
    assert [(p[0], p[3]) for p in queue(ns, link)["puts"]] == [(img.ino, "changed")]
    ns.do(C.Unlink, VOL, d, b"img.jpg")
    q = queue(ns, link)
    assert q["puts"] == []  # gone before its export: nothing to upload
    assert [row[0] for row in q["deletes"]] == ["pre/img.jpg"]


def test_a_rename_exports_the_new_name_and_deletes_the_old(ns: Driver) -> None:
    link, d = linked(ns)
    f = ns.create(d, b"tmp.part")
    ns.write(f.ino, 0, 0, 5)
    ns.do(C.Rename, VOL, d, b"tmp.part", d, b"final.bin")
    q = queue(ns, link)
    assert [(p[0], p[1]) for p in q["puts"]] == [(f.ino, "pre/final.bin")]  # its path when exported
    assert [row[0] for row in q["deletes"]] == ["pre/tmp.part"]
    # an upload done drops the deletes of its key queued before it
    g = ns.create(d, b"tmp.part")
    ns.write(g.ino, 0, 0, 1)
    put = next(p for p in queue(ns, link)["puts"] if p[0] == g.ino)
    ns.do(C.ExportDone, link, g.ino, put[1], put[2])
    assert [row[0] for row in queue(ns, link)["deletes"]] == []


def test_failed_exports_wait_and_repo_export_makes_them_pending_again(ns: Driver) -> None:
    link, d = linked(ns, "")
    f = ns.create(d, b"a")
    ns.write(f.ino, 0, 0, 5)
    assert queue(ns, link)["puts"] == []  # no --auto-export
    assert ns.do(C.QueueExports, link, "") == {"queued": 1, "retried": 0}
    (put,) = queue(ns, link)["puts"]
    ns.do(C.ExportDone, link, f.ino, put[1], put[2], outcome="failed", error="AccessDenied")
    q = queue(ns, link)
    assert (q["pending"], q["failed"]) == (0, 1) and q["puts"][0][4] == "AccessDenied"
    now = ns.state.links[link].puts[f.ino][3]
    assert ns.state.repo_exports(link, 10, now + 1)["puts"] == []  # not due yet
    assert ns.do(C.QueueExports, link, "")["retried"] == 1
    assert queue(ns, link)["pending"] == 1


def test_the_queue_survives_a_snapshot(ns: Driver) -> None:
    link, d = linked(ns)
    f = ns.create(d, b"a")
    ns.write(f.ino, 0, 0, 5)
    ns.do(C.Unlink, VOL, d, b"a")
    g = ns.create(d, b"b")
    ns.write(g.ino, 0, 0, 5)
    blob = ns.state.snapshot()
    other = MetaState()
    other.restore(blob)
    assert other.snapshot() == blob
    assert Q.RepoExports(link).run(other) == queue(ns, link)
    h = Driver(other, client="u").create(d, b"c")  # the restored replica goes on queueing
    assert h.ino in other.links[link].puts


def test_a_released_file_reads_from_its_object_and_only_as_it_was_compared(ns: Driver) -> None:
    link, d = linked(ns, "new")
    f = ns.create(d, b"f.bin")
    ns.write(f.ino, 0, 0, 1000)
    (put,) = queue(ns, link)["puts"]
    rel = (VOL, link, d, b"f.bin", f.ino)
    version = ns.state.getattr(VOL, f.ino).version
    with pytest.raises(Busy, match="export queued"):
        ns.do(C.ReleaseFile, *rel, version, '"etag"')
    ns.do(C.ExportDone, link, f.ino, put[1], put[2])
    with pytest.raises(Stale, match="changed since"):
        ns.do(C.ReleaseFile, *rel, version - 1, '"etag"')
    with pytest.raises(Stale, match="no longer inode"):
        ns.do(C.ReleaseFile, VOL, link, d, b"other", f.ino, version, '"etag"')
    outside = ns.create(1, b"out.bin")
    ns.write(outside.ino, 0, 0, 10)
    with pytest.raises(InvalidArgument, match="not under repository link"):
        ns.do(C.ReleaseFile, VOL, link, 1, b"out.bin", outside.ino, ns.state.getattr(VOL, outside.ino).version, '"e"')
    (old,) = [row[0] for row in Q.ReadChunk(VOL, f.ino, 0).run(ns.state)]
    used = ns.state.volumes[VOL].used_bytes
    trash = len(ns.state.volumes[VOL].trash)
    assert ns.do(C.ReleaseFile, *rel, version, '"etag"') == {"released": 1000}
    assert ns.state.volumes[VOL].used_bytes == used - 1000 and len(ns.state.volumes[VOL].trash) > trash
    assert {e.slice_id for e in Q.ListTrash(VOL, 100).run(ns.state)} >= {old}
    (new,) = Q.ReadChunk(VOL, f.ino, 0).run(ns.state)
    assert is_repo_slice(new[0]) and new[2] == 1000
    obj = ns.state.repo_object(VOL, new[0])
    assert (obj["key"], obj["etag"], obj["size"]) == ("pre/f.bin", '"etag"', 1000)
    attr = ns.state.getattr(VOL, f.ino)
    assert (attr.size, attr.version) == (1000, version)  # the same bytes: nothing for readers to drop
    assert ns.do(C.ReleaseFile, *rel, version, '"etag"') == {"released": 0}  # the bucket's already
    assert queue(ns, link)["puts"] == []
    ns.check()
