"""The importer and the repo block source against a second S3 implementation, moto's server.

The in-process metanode is the real state machine and service over real
RPC. What runs here: a paginated listing that is interrupted and resumes
where it stopped (nothing lost, nothing twice), ranged block reads, and the
errors of a changed object and a missing bucket, naming the link.
"""

from __future__ import annotations

import errno
import random
from collections.abc import Iterator

import boto3
import pytest
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError, Stale
from cachefs.ids import BlockKey
from cachefs.repo.hedge import Latencies
from cachefs.repo.importer import import_listing
from cachefs.repo.s3 import S3Store
from cachefs.repo.source import RepoBlocks
from cachefs.rpc import RpcPool
from cachefs.testing.metanode import local_metanode
from cachefs.testing.s3server import MOTO_ENV, moto_s3

BS = 64 * 1024  # a small block size: several blocks per object


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name, value in MOTO_ENV.items():
        monkeypatch.setenv(name, value)
    with moto_s3() as endpoint:
        yield endpoint


class Interrupted(Exception):
    pass


async def test_an_interrupted_import_resumes_and_reads_match_the_objects(moto: str) -> None:
    s3 = boto3.client("s3", endpoint_url=moto)
    s3.create_bucket(Bucket="data")
    rng = random.Random(7)
    objects = {f"set/c{i % 3}/f{i:02d}.bin": rng.randbytes(rng.randrange(0, 3 * BS)) for i in range(25)}
    for key, body in objects.items():
        s3.put_object(Bucket="data", Key=key, Body=body)
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.create_volume("v", block_size=BS)
        mc = meta.client(pool)
        d = await mc.mutate(C.Mkdir("v", 1, b"ds", 0o755, 0, 0))
        link = await mc.mutate(C.LinkRepo("v", d.ino, "data", "set/", moto))
        store = S3Store("data", name=f"repository link {link['id']}", endpoint=moto)
        calls = 0

        async def dies_after_two_pages(cmd: C.ImportObjects) -> dict[str, int]:
            nonlocal calls
            calls += 1
            if calls > 2:
                raise Interrupted
            return await mc.mutate(cmd)

        with pytest.raises(Interrupted):  # the link's directory, then a page of set/c0/
            await import_listing(dies_after_two_pages, link, store, {"": ""}, page=4, parallel=1)
        (link,) = await mc.query(Q.ListRepoLinks())
        c0 = sorted(k for k in objects if k.startswith("set/c0/"))
        assert link["objects"] == 4 and link["pending"] == 3 and not link["imported_ns"]
        pending = await mc.query(Q.RepoPending(link["id"]))
        assert pending == {"c0/": c0[3].removeprefix("set/"), "c1/": "", "c2/": ""}
        totals = await import_listing(mc.mutate, link, store, pending, page=4)
        assert (totals["created"], totals["listed"], totals["dirs"]) == (21, 21, 3)
        (link,) = await mc.query(Q.ListRepoLinks())
        assert link["objects"] == 25 and link["imported_ns"] and link["pending"] == 0

        source = RepoBlocks(None, mc.query)
        for key, body in objects.items():
            parent = d.ino
            for part in key.removeprefix("set/").split("/"):
                attr = await mc.query(Q.Lookup("v", parent, part.encode()))
                parent = attr.ino
            assert attr.size == len(body)
            got = bytearray()
            for rec in await mc.query(Q.ReadChunk("v", attr.ino, 0)):
                for index in range(-(-len(body) // BS)):
                    got += await source.get_block("v", BlockKey(rec.id, index))
            assert bytes(got) == body
        assert source.repo_reads == sum(-(-len(b) // BS) for b in objects.values())

        key = next(k for k, b in objects.items() if len(b) > BS + 100)
        attr = await mc.query(Q.Lookup("v", (await mc.query(Q.Lookup("v", d.ino, key.split("/")[1].encode()))).ino,
                                       key.split("/")[2].encode()))  # fmt: skip
        (rec,) = await mc.query(Q.ReadChunk("v", attr.ino, 0))
        part = await source.get_block("v", BlockKey(rec.id, 1), 100, 50)  # a range of a block
        assert part == objects[key][BS + 100 : BS + 150]
        s3.put_object(Bucket="data", Key=key, Body=b"changed")
        with pytest.raises(Stale, match=f"repository link {link['id']} .*changed since it was imported"):
            await source.get_block("v", BlockKey(rec.id, 0))

        gone = S3Store("nope-bucket", name="repository link 9", endpoint=moto)
        with pytest.raises(CacheFSError, match="repository link 9: bucket 'nope-bucket' does not exist"):
            await gone.check()


async def test_a_sync_lists_prefixes_in_parallel_and_drops_deleted_objects(moto: str) -> None:
    s3 = boto3.client("s3", endpoint_url=moto)
    s3.create_bucket(Bucket="wide")
    keys = [f"d{i:02d}/{j}/f{k}" for i in range(12) for j in "ab" for k in range(3)] + ["top", "d00/x"]
    for key in keys:
        s3.put_object(Bucket="wide", Key=key, Body=key.encode())
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.create_volume("v", block_size=BS)
        mc = meta.client(pool)
        d = await mc.mutate(C.Mkdir("v", 1, b"w", 0o755, 0, 0))
        link = await mc.mutate(C.LinkRepo("v", d.ino, "wide", "", moto))
        store = S3Store("wide", name=f"repository link {link['id']}", endpoint=moto)
        totals = await import_listing(mc.mutate, link, store, {"": ""}, page=2, parallel=6)
        assert (totals["created"], totals["dirs"]) == (len(keys), 1 + 12 + 24)

        async def names(path: str) -> set[bytes]:
            ino = d.ino
            for part in path.split("/") if path else []:
                ino = (await mc.query(Q.Lookup("v", ino, part.encode()))).ino
            return {e.name for e in await mc.query(Q.ReadDir("v", ino, 0, 1000))}

        assert await names("") == {b"top", *(f"d{i:02d}".encode() for i in range(12))}
        assert await names("d00") == {b"a", b"b", b"x"}
        local = await mc.mutate(C.Mknod("v", (await mc.query(Q.Lookup("v", d.ino, b"d03"))).ino, b"local",
                                        0o100644, 0, 0, 0))  # fmt: skip
        gone = [k for k in keys if k.startswith(("d03/", "d05/a/"))] + ["top", "d00/a/f1"]
        s3.delete_objects(Bucket="wide", Delete={"Objects": [{"Key": k} for k in gone]})
        s3.put_object(Bucket="wide", Key="d07/new", Body=b"new")
        totals = await import_listing(mc.mutate, link, store, {"": ""}, page=2, parallel=6)
        assert (totals["created"], totals["deleted"], totals["updated"]) == (1, len(gone), 0)
        assert await names("") == {*(f"d{i:02d}".encode() for i in range(12))}  # d03 holds a local file
        assert await names("d03") == {b"local"} and local.ino
        assert await names("d05") == {b"b"} and await names("d00/a") == {b"f0", b"f2"}
        assert b"new" in await names("d07")
        (link,) = await mc.query(Q.ListRepoLinks())
        assert link["objects"] == len(keys) - len(gone) + 1


class Throttle:
    """An HTTP front of the S3 server that answers 503 SlowDown to the next
    ``slow`` requests and forwards the rest (what S3 does under load), and
    holds back the first GET of the range ``hold`` until the test sets
    ``release`` (a request in the tail, for as long as the test wants)."""

    def __init__(self, upstream: str) -> None:
        import http.client
        import http.server
        import threading

        host, port = upstream.removeprefix("http://").split(":")
        front = self
        self.slow = 0
        self.refused = 0
        self.hold = ""  # a Range header: the first GET of it waits for ``release``
        self.held = threading.Event()  # set while that GET waits
        self.release = threading.Event()
        self.ranges: dict[str, int] = {}  # GETs per Range header
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "GET":
                    wanted = self.headers.get("Range", "")
                    with lock:
                        front.ranges[wanted] = front.ranges.get(wanted, 0) + 1
                        hold = bool(front.hold) and wanted == front.hold
                        if hold:
                            front.hold = ""
                    if hold:
                        front.held.set()
                        front.release.wait(60)
                if front.slow > 0:
                    front.slow -= 1
                    front.refused += 1
                    xml = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=10)
                conn.request(self.command, self.path, body, dict(self.headers))
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for name, value in reply.getheaders():
                    if name.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


async def test_throttling_is_retried_and_then_fails_naming_the_link(moto: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # boto's back-off after a SlowDown is rand() * 1 s * 2**attempt: about 9 s
    # of sleeping in this test, for a front that refuses by count, not time.
    # Its attempts are what is checked; 10 ms scales them down.
    from botocore.retries.standard import ExponentialBackoff

    monkeypatch.setitem(ExponentialBackoff._DEFAULT_BACKOFF_CONFIG, "throttling_base_scale", 0.01)
    s3 = boto3.client("s3", endpoint_url=moto)
    s3.create_bucket(Bucket="hot")
    s3.put_object(Bucket="hot", Key="k", Body=b"0123456789")
    etag = s3.head_object(Bucket="hot", Key="k")["ETag"]
    front = Throttle(moto)
    try:
        store = S3Store("hot", name="repository link 4 (s3://hot/)", endpoint=front.endpoint, attempts=4)
        front.slow = 2  # a burst of SlowDown: boto's back-off rides it out
        assert await store.get_range("k", 2, 6, etag) == b"2345"
        assert front.refused == 2
        front.slow = 100  # throttled for good: a clear error, after the attempts
        with pytest.raises(CacheFSError, match=r"repository link 4 \(s3://hot/\): reading 'k': SlowDown.*throttled"):
            await store.get_range("k", 2, 6, etag)
        assert front.refused >= 2 + 4  # every attempt boto was allowed (it may add one of its own)
        with pytest.raises(CacheFSError, match=r"repository link 4 \(s3://hot/\): listing: SlowDown.*throttled"):
            await store.list_page("", delimiter="/")  # a listing (link, sync, a lazy directory) too
    finally:
        front.close()


async def test_a_lazy_link_lists_each_directory_once_when_it_is_first_read(moto: str) -> None:
    s3 = boto3.client("s3", endpoint_url=moto)
    s3.create_bucket(Bucket="lazy")
    keys = ["top.bin", "c0/a.bin", "c0/b.bin", "c1/x/y.bin"] + [f"c2/f{i}" for i in range(20)]
    for key in keys:
        s3.put_object(Bucket="lazy", Key=key, Body=key.encode())
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.create_volume("v", block_size=BS)
        mc = meta.client(pool)
        d = await mc.mutate(C.Mkdir("v", 1, b"l", 0o755, 0, 0))
        link = await mc.mutate(C.LinkRepo("v", d.ino, "lazy", "", moto, "", "lazy"))
        assert (link["objects"], link["pending"]) == (0, 1)
        pages: list[str] = []
        propose = meta.service.repos._mutate

        async def counted(cmd: C.Command) -> object:
            pages.append(cmd.dir)
            return await propose(cmd)

        meta.service.repos._mutate = counted

        async def names(ino: int) -> set[bytes]:
            return {e.name for e in await mc.query(Q.ReadDir("v", ino, 0, 1000))}

        top = await mc.query(Q.Lookup("v", d.ino, b"top.bin"))  # the first lookup lists the link's directory
        assert top.size == len(b"top.bin") and pages == [""]
        assert await mc.query(Q.RepoPending(link["id"])) == {"c0/": "", "c1/": "", "c2/": ""}
        c0 = await mc.query(Q.Lookup("v", d.ino, b"c0"))
        assert await names(c0.ino) == {b"a.bin", b"b.bin"} and pages == ["", "c0/"]
        assert await names(c0.ino) == {b"a.bin", b"b.bin"} and pages == ["", "c0/"]  # listed once
        c2 = await mc.query(Q.Lookup("v", d.ino, b"c2"))
        found: list[int] = []

        async def look(i: int) -> None:
            found.append((await mc.query(Q.Lookup("v", c2.ino, f"f{i}".encode()))).size)

        async with trio.open_nursery() as nursery:  # readers at once: one listing
            for i in range(8):
                nursery.start_soon(look, i)
        assert sorted(found) == [len(f"c2/f{i}") for i in range(8)] and pages == ["", "c0/", "c2/"]
        with pytest.raises(CacheFSError) as missing:
            await mc.query(Q.Lookup("v", c2.ino, b"nope"))
        assert missing.value.errno == errno.ENOENT
        (link,) = await mc.query(Q.ListRepoLinks())
        assert (link["objects"], link["pending"], link["imported_ns"]) == (23, 1, 0)  # c1/ still to list
        c1 = await mc.query(Q.Lookup("v", d.ino, b"c1"))
        x = await mc.query(Q.LeaseLookup("v", c1.ino, b"x", ""))  # the client's lookup path lists too
        assert x.attr.mode & 0o040000 and pages[-1] == "c1/"
        assert await names(x.attr.ino) == {b"y.bin"}
        (link,) = await mc.query(Q.ListRepoLinks())
        assert link["objects"] == len(keys) and link["pending"] == 0 and link["imported_ns"]

        e = await mc.mutate(C.Mkdir("v", 1, b"e", 0o755, 0, 0))
        gone = await mc.mutate(C.LinkRepo("v", e.ino, "no-such-bucket", "", moto, "", "lazy"))
        with pytest.raises(CacheFSError, match=f"repository link {gone['id']} .*bucket 'no-such-bucket' does not"):
            await mc.query(Q.ReadDir("v", e.ino, 0, 100))


@pytest.mark.allow_log("cachefs.metanode.repos", "auto-import poll failed")
async def test_auto_import_polls_pick_up_new_changed_and_deleted_objects(
    moto: str, caplog: pytest.LogCaptureFixture
) -> None:
    s3 = boto3.client("s3", endpoint_url=moto)
    s3.create_bucket(Bucket="auto")
    for key in ("a", "b", "sub/c"):
        s3.put_object(Bucket="auto", Key=key, Body=key.encode())
    async with local_metanode(housekeeping=0.2) as meta, RpcPool(secret=None) as pool:
        await meta.create_volume("v", block_size=BS)
        mc = meta.client(pool)
        d = await mc.mutate(C.Mkdir("v", 1, b"auto", 0o755, 0, 0))
        link = await mc.mutate(C.LinkRepo("v", d.ino, "auto", "", moto, "", "full", 1))
        assert link["auto_import"] == 1

        async def names() -> dict[bytes, int]:
            out = {}
            for e in await mc.query(Q.ReadDir("v", d.ino, 0, 100)):
                out[e.name] = e.attr.size
            return out

        with trio.fail_after(20):  # nothing imported it but the poll
            while await names() != {b"a": 1, b"b": 1, b"sub": 4096} or not (await mc.query(Q.ListRepoLinks()))[0]["imported_ns"]:
                await trio.sleep(0.2)
        sub = await mc.query(Q.Lookup("v", d.ino, b"sub"))
        assert [e.name for e in await mc.query(Q.ReadDir("v", sub.ino, 0, 100))] == [b"c"]
        s3.put_object(Bucket="auto", Key="a", Body=b"changed")
        s3.delete_object(Bucket="auto", Key="b")
        s3.put_object(Bucket="auto", Key="new", Body=b"new!")
        with trio.fail_after(20):
            while await names() != {b"a": 7, b"new": 4, b"sub": 4096}:
                await trio.sleep(0.2)

        gone = await mc.mutate(C.Mkdir("v", 1, b"gone", 0o755, 0, 0))
        bad = await mc.mutate(C.LinkRepo("v", gone.ino, "no-such-bucket", "", moto, "", "full", 1))

        def failed() -> list[str]:
            return [r.getMessage() for r in caplog.records if "auto-import poll failed" in r.getMessage()]

        with trio.fail_after(20):  # failing polls are logged and tried again
            while len(failed()) < 2:
                await trio.sleep(0.2)
        assert f"repository link {bad['id']} (s3://no-such-bucket/): bucket 'no-such-bucket' does not exist" in failed()[0]
        assert await names() == {b"a": 7, b"new": 4, b"sub": 4096}  # the other link's files stay


async def test_a_slow_ranged_get_is_hedged_and_the_first_answer_wins(moto: str) -> None:
    s3 = boto3.client("s3", endpoint_url=moto)
    s3.create_bucket(Bucket="tail")
    body = bytes(range(256)) * 64
    s3.put_object(Bucket="tail", Key="k", Body=body)
    etag = s3.head_object(Bucket="tail", Key="k")["ETag"]
    front = Throttle(moto)
    try:
        store = S3Store("tail", name="repository link 6 (s3://tail/)", endpoint=front.endpoint)
        # Until it has learnt the usual latency the store would wait a minute
        # before a hedge: none while it learns, and the held GET below is
        # hedged in time only by the delay it learnt.
        store.latencies = Latencies(first=60.0)
        for i in range(store.latencies.min_samples):
            assert await store.get_range("k", i, i + 100, etag) == body[i : i + 100]
        assert store.hedges == 0 and sum(front.ranges.values()) == store.latencies.min_samples
        front.hold = "bytes=1000-2999"  # one try of the next GET sits in the tail until released
        try:
            with trio.fail_after(30):
                got = await store.get_range("k", 1000, 3000, etag)
            assert front.held.is_set() and not front.release.is_set()  # answered while one try was held
        finally:
            front.release.set()
        assert got == body[1000:3000] and store.hedges == 1 and front.ranges["bytes=1000-2999"] == 2
        with pytest.raises(Stale, match="repository link 6 .*changed since it was imported"):
            await store.get_range("k", 0, 10, '"not-the-etag"')  # a failure (of both tries, if hedged) is raised
    finally:
        front.close()


async def test_a_directorys_next_page_is_listed_while_the_page_before_commits(moto: str) -> None:
    s3 = boto3.client("s3", endpoint_url=moto)
    s3.create_bucket(Bucket="pages")
    for i in range(10):
        s3.put_object(Bucket="pages", Key=f"d/f{i:02d}", Body=b"%d" % i)
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.create_volume("v", block_size=BS)
        mc = meta.client(pool)
        d = await mc.mutate(C.Mkdir("v", 1, b"pages", 0o755, 0, 0))
        link = await mc.mutate(C.LinkRepo("v", d.ino, "pages", "d/", moto))
        store = S3Store("pages", name=f"repository link {link['id']}", endpoint=moto)
        listings: list[str] = []
        commits: list[str] = []
        list_page = store.list_page

        async def listing(*args: object, **kwargs: object) -> object:
            listings.append(str(kwargs.get("token", "")))
            return await list_page(*args, **kwargs)  # type: ignore[arg-type]

        async def commit(cmd: C.ImportObjects) -> dict[str, int]:
            if not cmd.done:  # more pages to come: the next one is asked for before this one commits
                with trio.fail_after(10):
                    while len(listings) < len(commits) + 2:
                        await trio.sleep(0.01)
            commits.append(cmd.cursor)
            return await mc.mutate(cmd)

        store.list_page = listing  # type: ignore[method-assign]
        totals = await import_listing(commit, link, store, {"": ""}, page=3, parallel=1)
        assert (totals["created"], totals["listed"], totals["dirs"]) == (10, 10, 1)
        assert commits == ["f02", "f05", "f08", "f09"] and len(listings) == 4  # in order, each page once
        names = [e.name for e in await mc.query(Q.ReadDir("v", d.ino, 0, 100))]
        assert names == [b"f%02d" % i for i in range(10)]
        (link,) = await mc.query(Q.ListRepoLinks())
        assert link["objects"] == 10 and link["pending"] == 0 and link["imported_ns"]
