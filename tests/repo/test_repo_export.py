"""Export to a real S3 server (SeaweedFS): files written through a real mount under a linked
directory become objects, from the replicated export queue, worked off by the metanode leader.

Every object is compared byte for byte with what was written; a large file
goes as a multipart upload. The last test kills (-9) the mount right after
its writes were acknowledged, then the exporting leader mid-queue: a new
leader finishes the queue, and every acknowledged file is in the bucket as
it was written, nothing else (an upload the dead leader finished but did
not record goes again: the same bytes to the same key).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import select
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from cachefs import queries as Q
from cachefs.errors import CacheFSError
from cachefs.ids import BlockKey, is_repo_slice
from cachefs.rpc import RpcPool
from cachefs.testing.labs import running_lab
from cachefs.testing.ports import free_port
from cachefs.testing.s3server import SeaweedS3

MiB = 1 << 20
BUCKET = "out"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with SeaweedS3(tmp_path_factory.mktemp("weed")) as server:
        env = server.env()
        c = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                         aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
        c.create_bucket(Bucket=BUCKET)
        yield server


def bucket(s3: SeaweedS3) -> Any:
    env = s3.env()
    return boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


def objects(s3: SeaweedS3, prefix: str) -> dict[str, bytes]:
    c = bucket(s3)
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", ())]
    return {k[len(prefix):]: c.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys}


@pytest.fixture(scope="module")
def lab(needs_fuse, s3: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Three metanodes (a leader to kill); every node has the S3 credentials, as on a real host."""
    with running_lab(tmp_path_factory.mktemp("exportlab"), metanodes=3, env=s3.env()) as lab:
        yield lab


@pytest.fixture(scope="module")
def mnt(lab: Any) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cachefs-export-mnt-"))
    lab.mount(str(path), "--attr-timeout", "0", "--entry-timeout", "0", l2=False)
    try:
        yield path
    finally:
        lab.umount()
        if os.path.ismount(path):
            subprocess.run(["fusermount3", "-u", "-z", str(path)], check=False)
        path.rmdir()


def repo_cli(lab: Any, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachefs.cli", "repo", *args, "--meta", ",".join(lab.meta_addrs),
            "--secret-file", str(lab.credential_file("admin"))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def status(lab: Any, path: str) -> dict[str, Any]:
    out = repo_cli(lab, "status", "lab", path, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 90) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def exported(lab: Any, path: str) -> Callable[[], bool]:
    return lambda: status(lab, path)["exports"]["pending"] == 0


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)  # close() returns once the data is committed: from then on it must reach the bucket


def test_written_files_are_exported_changed_and_deleted(s3, lab, mnt) -> None:
    c = bucket(s3)
    c.put_object(Bucket=BUCKET, Key="ds/imported.bin", Body=b"from the bucket")
    out = repo_cli(lab, "link", "lab", "/export", f"s3://{BUCKET}/ds", "--endpoint", s3.endpoint,
                   "--auto-export", "deleted,new,changed", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["auto_export"] == "new,changed,deleted"
    root = mnt / "export"
    rng = random.Random(3)
    files = {"small.txt": b"hello\n", "big.bin": rng.randbytes(40 * MiB + 17), "sub/dir/c.jpg": rng.randbytes(70_000),
             "empty": b""}
    for name, data in files.items():
        write(root / name, data)
    write(root / "imported.bin", b"changed in cachefs")  # an imported file, written: "changed"
    wait_for("the first exports", exported(lab, "/export"))
    want = {**files, "imported.bin": b"changed in cachefs"}
    assert objects(s3, "ds/") == want
    assert c.head_object(Bucket=BUCKET, Key="ds/big.bin")["ETag"].endswith('-3"')  # multipart: 3 parts of 16 MiB
    done = status(lab, "/export")["exports"]["done"]
    assert done >= len(want)  # more if the leader saw a file between two of its commits: each version goes

    write(root / "small.txt", b"hello again\n")  # changed after its export: exported again
    os.unlink(root / "sub/dir/c.jpg")  # deleted: the object goes
    os.rename(root / "empty", root / "renamed")  # the new name comes, the old one goes
    wait_for("the second exports", exported(lab, "/export"))
    want = {**want, "small.txt": b"hello again\n", "renamed": b""}
    del want["sub/dir/c.jpg"], want["empty"]
    assert objects(s3, "ds/") == want
    st = status(lab, "/export")
    assert st["exports"]["pending"] == st["exports"]["failed"] == 0 and st["exports"]["done"] >= done + 4, st
    assert st["failed_exports"] == []


def test_repo_export_uploads_what_auto_export_did_not(s3, lab, mnt) -> None:
    out = repo_cli(lab, "link", "lab", "/manual", f"s3://{BUCKET}/manual", "--endpoint", s3.endpoint)
    assert out.returncode == 0, out.stderr
    write(mnt / "manual" / "a" / "x.bin", b"x" * 5000)
    write(mnt / "manual" / "b.bin", b"b")
    # the commit that queues an export is the write's own: nothing queued at close() is nothing exported
    assert status(lab, "/manual")["exports"] == {"pending": 0, "failed": 0, "done": 0}
    assert objects(s3, "manual/") == {}
    out = repo_cli(lab, "export", "lab", "/manual/a", "--json")  # a directory inside the link
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"link": json.loads(out.stdout)["link"], "queued": 1, "retried": 0,
                                      "pending": 0, "failed": 0, "done": 1}
    assert objects(s3, "manual/") == {"a/x.bin": b"x" * 5000}
    out = repo_cli(lab, "export", "lab", "/manual")
    assert out.returncode == 0, out.stderr
    assert objects(s3, "manual/") == {"a/x.bin": b"x" * 5000, "b.bin": b"b"}
    bad = repo_cli(lab, "export", "lab", "/export-not-there")
    assert bad.returncode != 0 and "not-there" in bad.stderr


async def slices_of(lab: Any, path: str) -> set[int]:
    """The slice ids of file ``path`` of the lab volume."""
    async with RpcPool(secret=lab.credential("admin")) as pool:
        mc = lab.meta_client(pool)
        ino = 1
        for part in path.strip("/").split("/"):
            attr = await mc.query(Q.Lookup("lab", ino, part.encode()))
            ino = attr.ino
        return {s.id for chunk in range(-(-attr.size // (64 * MiB)))
                for s in await mc.query(Q.ReadChunk("lab", ino, chunk))}  # fmt: skip


async def stored_slices(lab: Any) -> set[int]:
    """Slice ids with a shard of the lab volume on some datanode."""
    async with RpcPool(secret=lab.credential("admin")) as pool:
        out: set[int] = set()
        for node in lab.of_kind("datanode"):
            cursor = ""
            while True:
                reply = await pool.call(node.addr, "list", {"volume": "lab", "cursor": cursor, "limit": 10_000},
                                        timeout=30)  # fmt: skip
                out |= {BlockKey.from_bytes(bytes(k)).slice_id for k, _i, _s in reply.result["shards"]}
                cursor = reply.result["cursor"]
                if not cursor:
                    break
        return out


def test_repo_release_gives_exported_files_blocks_back_and_they_read_from_the_bucket(s3, lab, mnt) -> None:
    out = repo_cli(lab, "link", "lab", "/rel", f"s3://{BUCKET}/rel", "--endpoint", s3.endpoint,
                   "--auto-export", "new,changed")
    assert out.returncode == 0, out.stderr
    data = {"old/big.bin": os.urandom(20 * MiB + 7),  # a multipart upload (16 MiB parts)
            "old/small.bin": os.urandom(300_000), "old/differs.bin": os.urandom(5000), "new.bin": b"new"}
    for name, body in data.items():
        write(mnt / "rel" / name, body)
    wait_for("the exports", exported(lab, "/rel"))
    bucket(s3).put_object(Bucket=BUCKET, Key="rel/old/differs.bin", Body=os.urandom(5000))  # not the file's bytes
    week_ago = time.time() - 8 * 86400
    for name in ("old/big.bin", "old/small.bin", "old/differs.bin"):
        os.utime(mnt / "rel" / name, (week_ago, week_ago))
    released = {name: lab.run(slices_of, lab, "/rel/" + name) for name in ("old/big.bin", "old/small.bin")}
    assert set().union(*released.values()) <= lab.run(stored_slices, lab)

    out = repo_cli(lab, "release", "lab", "/rel", "--older-than", "7d", "--json")
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout)
    assert counts == {"link": counts["link"], "released": 2, "in_bucket": 0, "differs": 1, "too_new": 1,
                      "refused": 0, "released_bytes": len(data["old/big.bin"]) + len(data["old/small.bin"])}
    for name in released:
        assert all(is_repo_slice(sid) for sid in lab.run(slices_of, lab, "/rel/" + name))
    again = json.loads(repo_cli(lab, "release", "lab", "/rel/old/big.bin", "--older-than", "0", "--json").stdout)
    assert (again["released"], again["in_bucket"]) == (0, 1)

    gc = subprocess.run([sys.executable, "-m", "cachefs.cli", "gc", "--delete", "--grace", "0", "--volume", "lab",
                         "--meta", ",".join(lab.meta_addrs), "--secret-file", str(lab.credential_file("admin"))],
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert gc.returncode == 0, gc.stderr
    assert not set().union(*released.values()) & lab.run(stored_slices, lab)  # their blocks left the datanodes
    lab.umount()  # a fresh mount: no L1 or page cache of the old blocks
    lab.mount(str(mnt), "--attr-timeout", "0", "--entry-timeout", "0", l2=False)
    for name, body in data.items():
        assert (mnt / "rel" / name).read_bytes() == body  # the released two through the cache node, from S3


class Proxy:
    """A TCP proxy to the S3 server on a port of its own, to stop and start again:
    an endpoint that goes away under a link and comes back."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.server: socketserver.ThreadingTCPServer | None = None

    def start(self) -> None:
        target = self.target

        class Pipe(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with socket.create_connection(("127.0.0.1", target)) as up:
                    socks = [self.request, up]
                    while True:
                        ready, _, _ = select.select(socks, [], [], 30)
                        if not ready:
                            return
                        for sock in ready:
                            data = sock.recv(65536)
                            if not data:
                                return
                            (up if sock is self.request else self.request).sendall(data)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", self.port), Pipe)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def test_a_failed_export_is_shown_naming_the_link_and_repo_export_retries_it(s3, lab, mnt) -> None:
    proxy = Proxy(s3.ports["s3.port"])
    proxy.start()
    try:
        endpoint = f"http://127.0.0.1:{proxy.port}"
        out = repo_cli(lab, "link", "lab", "/flaky", f"s3://{BUCKET}/flaky", "--endpoint", endpoint,
                       "--auto-export", "new", "--json")
        assert out.returncode == 0, out.stderr
        link = json.loads(out.stdout)
        proxy.stop()  # the endpoint goes away: every retry of the export fails
        write(mnt / "flaky" / "result.csv", b"epoch,loss\n1,0.5\n")
        wait_for("the export to fail", lambda: status(lab, "/flaky")["exports"]["failed"] == 1, timeout=180)
        st = status(lab, "/flaky")
        [(name, error)] = st["failed_exports"]
        assert name == "flaky/result.csv" and f"repository link {link['id']}" in error, st
        assert objects(s3, "flaky/") == {}
        proxy.start()  # back on the same port
        again = repo_cli(lab, "export", "lab", "/flaky", "--json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["retried"] == 1
        assert objects(s3, "flaky/") == {"result.csv": b"epoch,loss\n1,0.5\n"}
    finally:
        proxy.stop()


def links(lab: Any) -> list[dict[str, Any]]:
    async def ask() -> list[dict[str, Any]]:
        from cachefs.queries import ListRepoLinks

        async with RpcPool(secret=lab.credential("admin")) as pool:
            return await lab.meta_client(pool, deadline=10.0).query(ListRepoLinks())

    return lab.run(ask)


def test_a_full_import_killed_mid_way_resumes_where_it_stopped_through_a_leader_kill(s3, lab, mnt) -> None:
    """kill -9 of `repo link` mid-import, then of the metanode leader while
    the second `repo link` goes on from the cursors: every object once."""
    c = bucket(s3)
    keys = [f"many/p{i % 150:03d}/o{i:05d}" for i in range(3000)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: c.put_object(Bucket=BUCKET, Key=k, Body=k.encode()), keys))
    argv = [sys.executable, "-m", "cachefs.cli", "repo", "link", "lab", "/many", f"s3://{BUCKET}/many",
            "--endpoint", s3.endpoint, "--json", "--meta", ",".join(lab.meta_addrs),
            "--secret-file", str(lab.credential_file("admin"))]
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: list[dict[str, Any]] = []

    def some_imported() -> bool:
        seen[:] = [lk for lk in links(lab) if lk["url"] == f"s3://{BUCKET}/many/"]
        return bool(seen) and seen[0]["objects"] >= 300

    try:
        wait_for("the first imported pages", some_imported, timeout=120)
    finally:
        first.kill()
        first.wait()
    (cut,) = [lk for lk in links(lab) if lk["url"] == f"s3://{BUCKET}/many/"]
    assert 0 < cut["objects"] < len(keys) and cut["pending"] > 0 and not cut["imported_ns"], cut  # mid-way

    second = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = found_leaders(lab)
    try:
        wait_for("the resumed import to go on", lambda: links(lab)[-1]["objects"] > cut["objects"], timeout=120)
        lab.kill(killed)  # the leader, while the import goes on: the CLI's client finds the next one
        out, err = second.communicate(timeout=300)
    finally:
        if second.poll() is None:
            second.kill()
        lab.start(killed)
    assert second.returncode == 0, err
    totals = json.loads(out)["import"]
    # it went on from the cursors: it did not list again what the first run imported
    assert 0 < totals["created"] <= len(keys) - cut["objects"]
    assert totals["created"] + totals["unchanged"] < len(keys) - cut["objects"] // 2, totals
    (done,) = [lk for lk in links(lab) if lk["url"] == f"s3://{BUCKET}/many/"]
    assert done["objects"] == len(keys) and done["pending"] == 0 and done["imported_ns"], done
    names = sorted(str(p.relative_to(mnt / "many")) for p in (mnt / "many").rglob("o*"))
    assert names == sorted(k.removeprefix("many/") for k in keys)  # every object once, nothing else
    some = mnt / "many" / keys[2345].removeprefix("many/")
    assert some.read_bytes() == keys[2345].encode()


def meta_status(lab: Any) -> list[dict[str, Any]]:
    async def ask() -> list[dict[str, Any]]:
        out = []
        async with RpcPool(secret=lab.credential("admin")) as pool:
            for node in lab.of_kind("metanode"):
                if node.pid:
                    try:
                        out.append({**(await pool.call(node.addr, "meta_status", timeout=2)).result,
                                    "name": node.name})
                    except CacheFSError:
                        pass
        return out

    return lab.run(ask)


def found_leaders(lab: Any) -> str:
    names = [s["name"] for s in meta_status(lab) if s["is_leader"]]
    return names[0] if len(names) == 1 else ""


def mount_pid(mountpoint: Path) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"cachefs.cli" in argv and b"mount" in argv and str(mountpoint).encode() in argv:
                return int(entry.name)
    raise AssertionError(f"no mount daemon of {mountpoint}")


def test_kill_9_of_the_mount_and_of_the_exporting_leader_mid_queue_loses_nothing(s3, lab, mnt) -> None:
    out = repo_cli(lab, "link", "lab", "/kill", f"s3://{BUCKET}/kill", "--endpoint", s3.endpoint,
                   "--auto-export", "new")
    assert out.returncode == 0, out.stderr
    rng = random.Random(9)
    files = {f"f{i:02d}.bin": rng.randbytes(4 * MiB + i) for i in range(40)}
    for name, data in files.items():
        write(mnt / "kill" / name, data)
    pid = mount_pid(mnt)
    os.kill(pid, signal.SIGKILL)  # every file above was acknowledged by close(): its export must happen anyway
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)

    first = found_leaders(lab)
    listed: list[int] = []

    def started() -> bool:
        keys = bucket(s3).list_objects_v2(Bucket=BUCKET, Prefix="kill/").get("KeyCount", 0)
        listed.append(keys)
        return keys > 0

    wait_for("the first exported object", started, timeout=60)
    lab.kill(first)  # the exporter, mid-queue
    assert 0 < listed[-1] < len(files), listed  # the kill came while the queue was being worked off
    try:
        wait_for("a new leader", lambda: found_leaders(lab) not in ("", first))
        wait_for("the queue on the new leader", exported(lab, "/kill"), timeout=120)
        assert objects(s3, "kill/") == files
        st = status(lab, "/kill")["exports"]
        assert st["pending"] == st["failed"] == 0 and st["done"] >= len(files), st
    finally:
        lab.start(first)
