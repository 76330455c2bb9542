"""Tree clones in the state machine: copies share slices, and a slice reaches
the trash (so the collector) only when no file holds it any more."""

from __future__ import annotations

import errno

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefs import commands as C
from cachefs.errors import CacheFSError
from cachefs.ids import CHUNK_SIZE
from cachefs.metanode.backup import dump_volume, parse
from cachefs.metanode.namespace import MetaState
from cachefs.metanode.snapshot import volume_row

from .nsdriver import VOL, Driver


def errno_of(fn, *args, **kw) -> int:
    with pytest.raises(CacheFSError) as info:
        fn(*args, **kw)
    return info.value.errno


def clone(ns: Driver, src_parent: int, name: bytes, dst_parent: int, new_name: bytes, limit: int = 2) -> int:
    """The CLI's walk (cachefs/cli/tree.py), in small pages so that paging is exercised."""
    top = ns.do(C.CloneEntry, VOL, src_parent, name, dst_parent, new_name)
    todo = [(ns.state.lookup(VOL, src_parent, name).ino, top["ino"])] if top["is_dir"] else []
    while todo:
        src, dst = todo.pop()
        cookie = None
        while cookie != 0:
            step = ns.do(C.CloneDir, VOL, src, dst, cookie or 0, limit)
            todo.extend(tuple(pair) for pair in step["dirs"])
            cookie = step["cookie"]
    return top["ino"]


def trashed(ns: Driver) -> set[int]:
    return {r[0] for r in ns.state.trash(VOL, 10_000)}


def records(ns: Driver, ino: int) -> list[list[tuple[int, int, int, int]]]:
    size = ns.state.getattr(VOL, ino).size
    return [ns.state.read_chunk(VOL, ino, c) for c in range(-(-size // CHUNK_SIZE))]


@pytest.fixture
def tree() -> tuple[Driver, dict[str, int]]:
    ns = Driver().volume()
    d = ns.mkdir(1, b"data").ino
    sub = ns.mkdir(d, b"sub").ino
    f = ns.create(d, b"f").ino
    ns.write(f, 0, 0, 1000)
    ns.write(f, 0, 500, 1000)
    ns.write(f, 1, 0, 10)
    g = ns.create(sub, b"g").ino
    ns.write(g, 0, 0, 300)
    ns.do(C.SetXattr, VOL, g, b"user.k", b"v")
    ns.do(C.Symlink, VOL, sub, b"s", b"../f", 0, 0)
    for i in range(5):
        ns.create(sub, b"e%d" % i)
    return ns, {"data": d, "sub": sub, "f": f, "g": g}


def test_a_clone_copies_the_tree_and_shares_its_slices(tree) -> None:
    ns, ino = tree
    copy = clone(ns, 1, b"data", 1, b"v2")
    st_, new = ns.state, ns.state.lookup
    f2 = new(VOL, copy, b"f")
    sub2 = new(VOL, copy, b"sub")
    g2 = new(VOL, sub2.ino, b"g")
    assert f2.ino != ino["f"] and records(ns, f2.ino) == records(ns, ino["f"])
    assert (f2.size, f2.mode, f2.mtime_ns) == (st_.getattr(VOL, ino["f"]).size, st_.getattr(VOL, ino["f"]).mode,
                                              st_.getattr(VOL, ino["f"]).mtime_ns)
    assert st_.getxattr(VOL, g2.ino, b"user.k") == b"v"
    assert st_.readlink(VOL, new(VOL, sub2.ino, b"s").ino) == b"../f"
    assert sorted(e.name for e in st_.readdir(VOL, sub2.ino, 0, 100)) == sorted(
        e.name for e in st_.readdir(VOL, ino["sub"], 0, 100))
    assert st_.usage(VOL, copy)[:2] == st_.usage(VOL, ino["data"])[:2]
    assert st_.volumes[VOL].shared == {1: 1, 2: 1, 3: 1, 4: 1}
    ns.check()


def test_a_shared_slice_is_trashed_only_when_its_last_holder_goes(tree) -> None:
    ns, ino = tree
    copy = clone(ns, 1, b"data", 1, b"v2")
    f2 = ns.state.lookup(VOL, copy, b"f").ino
    before = records(ns, ino["f"])
    ns.write(f2, 0, 0, 2000)  # covers slices 1 and 2 in the copy only
    assert trashed(ns) == set() and records(ns, ino["f"]) == before
    ns.do(C.SetAttr, VOL, ino["f"], size=100)  # the original drops 2 and 3
    assert trashed(ns) == {2}  # 3 is still the copy's
    assert records(ns, f2)[1] == [(3, 0, 10, 0)]
    sub2 = ns.state.lookup(VOL, copy, b"sub").ino
    ns.do(C.Unlink, VOL, sub2, b"g")  # the copy of g goes: g still holds slice 4
    assert 4 not in trashed(ns)
    ns.do(C.Unlink, VOL, ino["sub"], b"g")
    assert 4 in trashed(ns)
    ns.do(C.Unlink, VOL, copy, b"f")
    assert trashed(ns) == {2, 3, 4, 5}  # 1: the original f holds its first 100 bytes still
    assert records(ns, ino["f"]) == [[(1, 0, 100, 0)]]
    ns.check()


def test_the_trash_never_holds_a_slice_a_file_reads(tree) -> None:
    ns, ino = tree
    clone(ns, 1, b"data", 1, b"v2")
    clone(ns, 1, b"v2", 1, b"v3")
    held = {s for path in (b"data", b"v2", b"v3") for s in _slices(ns, ns.state.lookup(VOL, 1, path).ino)}
    assert held and not held & trashed(ns)
    ns.do(C.Rename, VOL, 1, b"v3", ino["sub"], b"moved")
    ns.check()


def _slices(ns: Driver, dir_ino: int) -> set[int]:
    out: set[int] = set()
    for e in ns.state.readdir(VOL, dir_ino, 0, 1000):
        if e.attr.is_dir:
            out |= _slices(ns, e.attr.ino)
        elif e.attr.is_reg:
            out |= {r[0] for chunk in records(ns, e.attr.ino) for r in chunk}
    return out


def test_shared_counts_survive_snapshots_and_backups(tree) -> None:
    ns, ino = tree
    clone(ns, 1, b"data", 1, b"v2")
    again = MetaState()
    again.restore(ns.state.snapshot())
    assert again.volumes[VOL].shared == ns.state.volumes[VOL].shared != {}
    assert again.snapshot() == ns.state.snapshot()
    backup = parse(dump_volume(ns.state, VOL))
    assert backup.volume.shared == ns.state.volumes[VOL].shared
    # and the restored state frees nothing early: drop the original, the copy keeps its slices
    d = Driver(again)
    d.do(C.Unlink, VOL, ino["data"], b"f")
    assert trashed(d) == set()
    d.check()


def test_refusals_change_nothing(tree) -> None:
    ns, ino = tree
    ns.create(1, b"f")
    before = volume_row(ns.state.volumes[VOL])
    assert errno_of(ns.do, C.CloneEntry, VOL, 1, b"data", ino["sub"], b"x") == errno.EINVAL  # into itself
    assert errno_of(ns.do, C.CloneEntry, VOL, 1, b"data", 1, b"data") == errno.EEXIST
    assert errno_of(ns.do, C.CloneEntry, VOL, 1, b"nope", 1, b"x") == errno.ENOENT
    assert errno_of(ns.do, C.CloneEntry, VOL, 1, b"data", ino["f"], b"x") == errno.ENOTDIR
    assert errno_of(ns.do, C.CloneDir, VOL, ino["data"], ino["sub"], 0, 10) == errno.EINVAL
    assert errno_of(ns.do, C.CloneDir, VOL, ino["data"], 1, 0, 10) == errno.EEXIST  # "f" is taken in /
    assert errno_of(C.CloneDir, VOL, ino["sub"], 1, 0, C.MAX_TREE_BATCH + 1) == errno.EINVAL
    assert volume_row(ns.state.volumes[VOL]) == before
    q = ns.mkdir(1, b"quota").ino
    ns.do(C.SetQuota, VOL, q, 1500, None)
    # the top copy is an empty directory (it fits); filling it with f's 2010 bytes does not
    top = ns.do(C.CloneEntry, VOL, 1, b"data", q, b"v2")["ino"]
    assert errno_of(ns.do, C.CloneDir, VOL, ino["data"], top, 0, 10) == errno.EDQUOT
    assert ns.state.readdir(VOL, top, 0, 10) == [] and ns.state.volumes[VOL].shared == {}
    ns.check()


def test_a_file_clones_alone(tree) -> None:
    ns, ino = tree
    top = ns.do(C.CloneEntry, VOL, ino["data"], b"f", 1, b"f2")
    assert not top["is_dir"] and top["bytes"] == ns.state.volumes[VOL].inodes[ino["f"]].stored
    assert records(ns, top["ino"]) == records(ns, ino["f"])
    ns.check()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["write", "cover", "trunc", "unlink", "clone", "compact"]),
                          st.integers(0, 7), st.integers(0, 3)), max_size=30))
def test_random_edits_of_clones_keep_every_held_slice_out_of_the_trash(ops) -> None:
    ns = Driver().volume()
    dirs = [ns.mkdir(1, b"d0").ino]
    for i in range(3):
        f = ns.create(dirs[0], b"f%d" % i).ino
        ns.write(f, 0, 0, 100 + i)
    for n, (op, pick, arg) in enumerate(ops):
        d = dirs[pick % len(dirs)]
        files = [e for e in ns.state.readdir(VOL, d, 0, 100) if e.attr.is_reg]
        target = files[pick % len(files)].attr.ino if files else None
        if op == "clone":
            dirs.append(clone(ns, 1, ns.state.readdir(VOL, 1, 0, 100)[pick % len(dirs)].name, 1, b"c%d" % n))
        elif target is None:
            continue
        elif op == "write":
            ns.write(target, arg % 2, arg * 10, 50)
        elif op == "cover":
            ns.write(target, 0, 0, 1000)
        elif op == "trunc":
            ns.do(C.SetAttr, VOL, target, size=arg * 20)
        elif op == "unlink":
            ns.do(C.Unlink, VOL, d, files[pick % len(files)].name)
        elif op == "compact":
            recs = ns.state.read_chunk(VOL, target, 0)
            if recs:
                new = ns.do(C.AllocSlices, 1)
                end = max(p + ln for _s, p, ln, _o in recs)
                ns.do(C.CompactChunk, VOL, target, 0, [v for r in recs for v in r], new, end)
        ns.check()  # the invariants: shared counts recount, no held slice in the trash
    held = {s for d in {e.attr.ino for e in ns.state.readdir(VOL, 1, 0, 100)} for s in _slices(ns, d)}
    assert not held & trashed(ns)


# -- tree delete ---------------------------------------------------------------------


def purge_all(ns: Driver, root: int, limit: int = 3, keep: frozenset[int] = frozenset()) -> int:
    """The leader's loop (MetaService.purge_trees), with the files in ``keep`` open."""
    from cachefs.metanode.trees import purge_batch

    steps = 0
    while root in ns.state.volumes[VOL].doomed:
        batch = purge_batch(ns.state.volumes[VOL], root, limit)
        free = tuple(c.ino for _d, _n, c in batch if not c.is_dir and c.ino not in keep)
        assert ns.do(C.PurgeTree, VOL, root, limit, (), free) == len(batch)
        ns.check()  # after every step: usage, links, the tree being deleted is a root
        steps += 1
    return steps


def test_a_deleted_tree_leaves_at_once_and_is_purged_deepest_first(tree) -> None:
    ns, ino = tree
    usage = ns.state.usage(VOL, ino["data"])
    done = ns.do(C.DeleteTree, VOL, 1, b"data")
    assert done == {"ino": ino["data"], "inodes": usage.inodes + 1}
    assert errno_of(ns.state.lookup, VOL, 1, b"data") == errno.ENOENT
    assert ns.state.usage(VOL, 1)[:2] == (0, 0)
    [row] = ns.state.tree_deletes(VOL)
    assert row == {"ino": ino["data"], "since_ns": row["since_ns"], "inodes": usage.inodes + 1,
                   "left": usage.inodes + 1} and row["since_ns"] > 0
    ns.check()
    again = MetaState()
    again.restore(ns.state.snapshot())  # mid-delete: the list is in the snapshot
    assert again.volumes[VOL].doomed == ns.state.volumes[VOL].doomed
    steps = purge_all(ns, ino["data"])
    assert steps == -(-(usage.inodes + 1) // 3)
    assert ns.state.tree_deletes(VOL) == [] and set(ns.state.volumes[VOL].inodes) == {1}
    assert trashed(ns) == {1, 2, 3, 4}
    assert ns.state.volumes[VOL].used_bytes == 0


def test_a_deleted_clone_keeps_the_slices_its_source_holds(tree) -> None:
    ns, ino = tree
    clone(ns, 1, b"data", 1, b"v2")
    v2 = ns.state.lookup(VOL, 1, b"v2").ino
    ns.do(C.DeleteTree, VOL, 1, b"v2")
    purge_all(ns, v2, limit=1000)
    assert trashed(ns) == set() and ns.state.volumes[VOL].shared == {}
    assert records(ns, ino["f"]) == [[(1, 0, 1000, 0), (2, 500, 1000, 0)], [(3, 0, 10, 0)]]
    ns.check()


def test_open_files_of_a_deleted_tree_stay_as_orphans(tree) -> None:
    ns, ino = tree
    ns.do(C.DeleteTree, VOL, 1, b"data")
    purge_all(ns, ino["data"], keep=frozenset({ino["g"]}))
    vol = ns.state.volumes[VOL]
    assert vol.orphans == {ino["g"]} and 4 not in trashed(ns)
    assert ns.state.read_chunk(VOL, ino["g"], 0) == [(4, 0, 300, 0)]  # still readable by whoever has it open
    ns.do(C.PurgeOrphans, VOL, (ino["g"],))
    assert 4 in trashed(ns)
    ns.check()


def test_tree_delete_refusals(tree) -> None:
    ns, ino = tree
    assert errno_of(ns.do, C.DeleteTree, VOL, ino["data"], b"f") == errno.ENOTDIR
    assert errno_of(ns.do, C.DeleteTree, VOL, 1, b"nope") == errno.ENOENT
    assert errno_of(ns.do, C.PurgeTree, VOL, ino["data"], 10) == errno.ENOENT  # not being deleted
    ns.check()


def test_trees_linked_to_s3_are_refused() -> None:
    ns = Driver().volume()
    top = ns.mkdir(1, b"top").ino
    repo = ns.mkdir(top, b"repo").ino
    ns.do(C.LinkRepo, VOL, repo, "bkt", "pre/", "http://127.0.0.1:9000")
    ns.mkdir(repo, b"inner")
    assert errno_of(ns.do, C.CloneEntry, VOL, top, b"repo", 1, b"x") == errno.EOPNOTSUPP
    x = ns.do(C.CloneEntry, VOL, 1, b"top", 1, b"x")["ino"]  # the top alone is fine...
    assert errno_of(ns.do, C.CloneDir, VOL, repo, x, 0, 10) == errno.EOPNOTSUPP  # ...its linked part is not
    assert errno_of(ns.do, C.DeleteTree, VOL, repo, b"inner") == errno.EOPNOTSUPP
    assert errno_of(ns.do, C.DeleteTree, VOL, 1, b"top") == errno.EBUSY  # holds a link
    ns.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["mknod", "mkdir", "write", "link_out", "move_out", "move_in", "purge"]),
                          st.integers(0, 50)), max_size=25))
def test_stale_clients_acting_inside_a_tree_being_deleted_keep_the_invariants(ops) -> None:
    """Clients that still hold inode numbers of a deleted tree may create,
    write, link and rename there while the leader purges it: every step
    keeps the namespace whole, and the purge still ends with the tree gone."""
    from cachefs.metanode.trees import purge_batch

    ns = Driver().volume()
    top = ns.mkdir(1, b"top").ino
    for d in range(2):
        sub = ns.mkdir(top, b"d%d" % d).ino
        for i in range(3):
            ns.write(ns.create(sub, b"f%d" % i).ino, 0, 0, 10 + i)
    ns.do(C.DeleteTree, VOL, 1, b"top")
    vol = ns.state.volumes[VOL]

    def doomed_inodes(want_dir: bool) -> list[int]:
        out, stack = [], [top] if top in vol.inodes else []
        while stack:
            d = vol.inodes[stack.pop()]
            for packed in d.data.entries.values():
                child = vol.inodes[packed & 0xFFFFFFFFFF]
                if child.is_dir:
                    stack.append(child.ino)
                if child.is_dir == want_dir:
                    out.append(child.ino)
        return ([top] if want_dir and top in vol.inodes else []) + out

    for n, (op, pick) in enumerate(ops):
        dirs, files = doomed_inodes(True), doomed_inodes(False)
        try:
            if op == "mknod" and dirs:
                ns.create(dirs[pick % len(dirs)], b"new%d" % n)
            elif op == "mkdir" and dirs:
                ns.mkdir(dirs[pick % len(dirs)], b"newd%d" % n)
            elif op == "write" and files:
                ns.write(files[pick % len(files)], 0, 0, 5)
            elif op == "link_out" and files:
                ns.do(C.Link, VOL, files[pick % len(files)], 1, b"linked%d" % n)
            elif op in ("move_out", "move_in") and len(dirs) > 1:
                d = vol.inodes[dirs[pick % len(dirs)]]
                if d.data.entries:
                    name = next(iter(d.data.entries))
                    if op == "move_out":
                        ns.do(C.Rename, VOL, d.ino, name, 1, b"out%d" % n)
                    else:
                        live = ns.mkdir(1, b"live%d" % n).ino
                        ns.do(C.Rename, VOL, 1, b"live%d" % n, d.ino, b"in%d" % n)
                        assert vol.inodes[live].parent == d.ino
            elif op == "purge" and top in vol.doomed:
                free = tuple(c.ino for _d, _n, c in purge_batch(vol, top, 2) if not c.is_dir)
                ns.do(C.PurgeTree, VOL, top, 2, (), free)
        except CacheFSError as exc:
            assert exc.errno in (errno.ENOENT, errno.EINVAL), exc  # raced the purge: refused, nothing changed
        ns.check()
    while top in vol.doomed:
        free = tuple(c.ino for _d, _n, c in purge_batch(vol, top, 1000) if not c.is_dir)
        ns.do(C.PurgeTree, VOL, top, 1000, (), free)
    ns.check()
    assert top not in vol.inodes
