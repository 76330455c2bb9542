"""Least privilege on real daemons: what a client and an admin credential may
do on metanodes, datanodes and cache nodes, refused before any handler runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import trio

from cachefs.credentials import Credential
from cachefs.errors import CacheFSError, PermissionDenied
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool

KEY = BlockKey(987654321, 0).to_bytes()


async def _code(pool: RpcPool, addr: str, method: str, args: dict, payload: bytes | None = None) -> str:
    try:
        await pool.call(addr, method, args, payload=payload, timeout=10)
    except CacheFSError as exc:
        return exc.code
    return "OK"


async def _usage(pool: RpcPool, small_lab) -> list:
    out = []
    for node in small_lab.of_kind("datanode") + small_lab.of_kind("cachenode"):
        stats = (await pool.call(node.addr, "stats", timeout=10)).result
        out.append((stats.get("used"), stats.get("shards"), stats.get("blocks")))
    return out


def test_a_client_credential_reaches_only_client_operations_on_its_volumes(small_lab) -> None:
    client = Credential.issue(small_lab.secret, "client", "job", ["lab"])
    data, cache, meta = (small_lab.of_kind(k)[0].addr for k in ("datanode", "cachenode", "metanode"))

    async def scenario():
        async with RpcPool(secret=small_lab.secret) as root, RpcPool(secret=client) as pool:
            before = await _usage(root, small_lab)
            expect = {
                # its own volume: the call reaches the handler (nothing is there)
                (data, "get", "lab"): "ENOENT", (data, "stat", "lab"): "ENOENT",
                (cache, "prefetch_status", None): "OK", (meta, "health", None): "OK",
                (cache, "get_many", "lab"): "OK",
                # another volume: refused, even for the operations it may do
                (data, "get", "other"): "EACCES", (data, "put", "other"): "EACCES",
                (cache, "get", "other"): "EACCES", (cache, "put", "other"): "EACCES",
                (cache, "prefetch", "other"): "EACCES", (cache, "get_many", "other"): "EACCES",
                # operations that are not a client's, on any volume
                (data, "delete", "lab"): "EACCES", (data, "list", "lab"): "EACCES",
                (data, "scrub", "lab"): "EACCES", (data, "volumes", None): "EACCES",
                (data, "stats", None): "EACCES", (cache, "stats", None): "EACCES",
                (meta, "raft_step", None): "EACCES", (meta, "raft_snapshot", None): "EACCES",
            }
            got = {}
            for (addr, method, volume), _ in expect.items():
                args: dict = {} if volume is None else {"volume": volume, "key": KEY}
                payload = None
                if method in ("get", "stat", "delete") and addr == data:
                    args["index"] = 0
                if method == "put":
                    payload = b"x" * 100
                    if addr == data:
                        args |= {"index": 0, "meta": b""}
                if method in ("prefetch", "get_many"):
                    args = {"volume": volume, "keys": [KEY]}
                if method in ("list", "scrub"):
                    args = {"volume": volume}
                if method == "raft_snapshot":
                    args = {"src": 1, "xfer": 1, "chunk": 0, "chunks": 1}
                got[(addr, method, volume)] = await _code(pool, addr, method, args, payload)
            assert got == expect
            assert await _usage(root, small_lab) == before  # nothing was stored or removed

    trio.run(scenario)


def test_an_admin_credential_administers_but_is_no_server(small_lab) -> None:
    admin = Credential.issue(small_lab.secret, "admin", "ops")
    data, meta = small_lab.of_kind("datanode")[0].addr, small_lab.of_kind("metanode")[0].addr

    async def scenario():
        async with RpcPool(secret=admin) as pool:
            assert "shards" in (await pool.call(data, "list", {"volume": "lab", "limit": 1}, timeout=10)).result
            assert (await pool.call(data, "stats", timeout=10)).result["id"]
            with pytest.raises(PermissionDenied, match="raft_step is not allowed for admin 'ops'"):
                await pool.call(meta, "raft_step", payload=b"\x90", timeout=10)

    trio.run(scenario)


def test_credential_issue_writes_a_private_file_the_commands_accept(small_lab, tmp_path) -> None:
    out = tmp_path / "job.cred"
    run = subprocess.run([sys.executable, "-m", "cachefs.cli", "credential", "issue", "--role", "client",
                          "--name", "job", "--volume", "lab", "-o", str(out), "--secret-file",
                          str(small_lab.secret_file)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert os.stat(out).st_mode & 0o777 == 0o600
    show = subprocess.run([sys.executable, "-m", "cachefs.cli", "credential", "show", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert json.loads(show.stdout) == {"key_id": "client:job:lab", "role": "client", "name": "job",
                                       "volumes": ["lab"]}
    assert Credential.from_json(out.read_text()) == Credential.issue(small_lab.secret, "client", "job", ["lab"])
    # A daemon refuses to start on a credential: it needs the cluster secret.
    daemon = subprocess.run([sys.executable, "-m", "cachefs.cli", "datanode", "--zone", "z1", "--data-dir",
                             str(tmp_path / "d"), "--capacity", "1G", "--listen", "127.0.0.1:1",
                             "--secret-file", str(out)], capture_output=True, text=True, timeout=60)
    assert daemon.returncode != 0 and "needs the cluster secret" in daemon.stderr


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cachefs.cli", *argv], capture_output=True, text=True, timeout=120)


def test_the_metanode_refuses_a_credential_of_the_wrong_role_naming_role_and_method(small_lab, tmp_path) -> None:
    """The lab's own credentials (ROOT/client.cred, ROOT/admin.cred) against
    the real metanode daemon through the real CLI: administration with a
    client credential is refused with the method, the caller and the role it
    needs, and done with the admin one; a client sees and mounts only its
    own volume."""
    meta = ",".join(small_lab.meta_addrs)
    client, admin = str(small_lab.credential_file("client")), str(small_lab.credential_file("admin"))
    volume = "roles-" + os.urandom(3).hex()

    refused = _cli("volume", "create", volume, "--policy", "replica:1", "--meta", meta, "--secret-file", client)
    assert refused.returncode != 0
    assert "create_volume is not allowed for client 'lab-client' (needs admin or server)" in refused.stderr
    refused = _cli("volume", "set", "lab", "--open", "--meta", meta, "--secret-file", client)
    assert "set_volume_access is not allowed for client 'lab-client' (needs admin or server)" in refused.stderr
    listed = _cli("volume", "list", "--json", "--meta", meta, "--secret-file", admin)
    assert volume not in json.loads(listed.stdout)

    made = _cli("volume", "create", volume, "--policy", "replica:1", "--meta", meta, "--secret-file", admin)
    assert made.returncode == 0, made.stderr
    assert set(json.loads(_cli("volume", "list", "--json", "--meta", meta, "--secret-file", admin).stdout)) >= {
        "lab", volume}
    assert set(json.loads(_cli("volume", "list", "--json", "--meta", meta, "--secret-file", client).stdout)) == {
        "lab"}

    # A mount of a volume the credential does not name is refused, naming both.
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = _cli("mount", meta, volume, str(mnt), "--secret-file", client)
    assert mount.returncode != 0 and not os.path.ismount(mnt)
    assert f"client 'lab-client' has no credential for volume '{volume}'" in mount.stderr + mount.stdout

    async def scenario():
        from cachefs import commands as C
        from cachefs import queries as Q
        from cachefs.metanode.client import MetaClient

        async with RpcPool(secret=small_lab.credential("client")) as pool:
            mc = MetaClient(pool, small_lab.meta_addrs, deadline=10.0)
            with pytest.raises(PermissionDenied, match="register_node is not allowed for client 'lab-client' "
                                                       r"\(needs server\)"):
                await mc.mutate(C.RegisterNode("datanode", "rogue", "127.0.0.1:9", "z1", 1 << 30))
            with pytest.raises(PermissionDenied, match="purge_trash is not allowed for client 'lab-client'"):
                await mc.mutate(C.PurgeTrash("lab", (1,)))
            with pytest.raises(PermissionDenied, match=f"has no credential for volume '{volume}'"):
                await mc.query(Q.GetAttr(volume, 1))
            assert "rogue" not in (await mc.query(Q.ClusterMap()))["datanodes"]

    trio.run(scenario)


def test_a_client_credential_writes_and_warms_its_volume(small_lab) -> None:
    """What a training job does (the native API, then ``cachefs warmup`` into
    the cache tier) needs no more than the client credential of its volume."""
    from cachefs.client.api import connect

    name = f"roles-warm-{os.urandom(3).hex()}"
    with connect(small_lab.meta_addrs, "lab", secret=small_lab.credential("client"), zone="z1") as fs:
        fs.write_bytes(f"/{name}", os.urandom(3 << 20))
    try:
        warm = _cli("warmup", "--volume", "lab", "--meta", ",".join(small_lab.meta_addrs), "--quiet",
                    "--secret-file", str(small_lab.credential_file("client")), f"/{name}")
        assert warm.returncode == 0, warm.stderr
        assert "1 file" in warm.stdout + warm.stderr, warm.stdout + warm.stderr
    finally:
        with connect(small_lab.meta_addrs, "lab", secret=small_lab.credential("client")) as fs:
            fs.remove(f"/{name}")
