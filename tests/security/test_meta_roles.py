"""Least privilege on the metanode (issue 14, item 8): the real service over
real RPC with a cluster secret, called with client, admin and server
credentials. A client reaches only its own volumes, and a volume with a
mount token only through a session that proved the token; it acts only on
sessions it opened and cannot collect or replay another client's answers;
administration needs an admin credential, the cluster map a server."""

from __future__ import annotations

import errno
import time
from collections.abc import AsyncIterator

import pytest
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.credentials import ADMINS, ANYONE, CLIENTS, SERVERS, Credential
from cachefs.errors import CacheFSError
from cachefs.metanode import backup
from cachefs.metanode.client import MetaClient
from cachefs.metanode.namespace import MetaState
from cachefs.metanode.raft.driver import RaftNode
from cachefs.metanode.service import MetaService
from cachefs.rpc import RpcPool
from cachefs.testing.metanode import LocalMetanode, local_metanode

SECRET = b"metanode-roles-test-secret"
TOKEN = "mount-token-of-t"

# Who may call each metanode method. A new method fails here until its
# author decides (the default is servers only).
ADMIN_ONLY = {"create_volume", "set_volume", "set_volume_access", "set_quota", "purge_trash",
              "list_trash", "list_repairs", "unreferenced_slices", "remove_node", "drain_node",
              "link_repo", "unlink_repo", "import_objects", "list_repo_links", "repo_pending", "dump_volume",
              "queue_repo_exports", "repo_export_done", "repo_exports", "repo_release_file",
              "restore_volume", "check_volume", "delete_volume", "drop_volume",
              "list_quotas", "metanode_add", "metanode_remove", "meta_sessions"}
SERVER_ONLY = {"register_node", "node_heartbeat", "raft_step", "raft_snapshot"}
FOR_CLIENTS = {"mount_volume", "close_session", "setattr", "mknod", "mkdir", "symlink", "link", "unlink",
               "rmdir", "rename", "setxattr", "removexattr", "alloc_slices", "write_slice", "compact_chunk", "fallocate",
               "lookup", "getattr", "readlink", "readdir", "statfs", "getxattr", "listxattr", "read_chunk",
               "get_usage", "list_volumes", "cluster_map", "open", "release", "session_heartbeat",
               "lease_lookup", "lease_getattr", "lease_open", "load_dir", "lease_poll", "repo_object",
               "submit_job", "cancel_job", "list_jobs", "clone_entry", "clone_dir", "delete_tree", "list_tree_deletes"}
FOR_ANYONE = {"meta_status"}
# Client methods that name no volume or session: what they touch is global
# (slice ids) or their answer is cut down to the caller's volumes.
UNSCOPED = {"alloc_slices", "list_volumes", "cluster_map", "list_jobs"}


def _served() -> dict[str, frozenset[str]]:
    out = {}
    for cls in (MetaService, RaftNode):
        for attr in dir(cls):
            name = getattr(getattr(cls, attr, None), "__rpc_name__", None)
            if name is not None:
                out[name] = getattr(cls, attr).__rpc_roles__
    return out


def test_every_metanode_method_declares_who_may_call_it() -> None:
    want = ({n: ADMINS for n in ADMIN_ONLY} | {n: SERVERS for n in SERVER_ONLY}
            | {n: CLIENTS for n in FOR_CLIENTS} | {n: ANYONE for n in FOR_ANYONE})
    assert _served() == want
    for cls in [*C.REQUESTS.values(), *Q.QUERIES.values()]:
        if CLIENTS <= cls.ROLES and cls.NAME not in UNSCOPED:
            fields = set(cls.__dataclass_fields__)
            assert fields & {"volume", "session"}, f"{cls.__name__}: a client method that names no volume"


def cred(role: str, name: str, *volumes: str) -> Credential:
    return Credential.issue(SECRET, role, name, list(volumes))


async def code(call) -> str:
    try:
        await call
    except CacheFSError as exc:
        return exc.code
    return "OK"


@pytest.fixture
async def meta() -> AsyncIterator[LocalMetanode]:
    async with local_metanode(secret=SECRET) as m:
        await m.create_volume("a")
        await m.create_volume("b")
        await m.service.mutate(C.CreateVolume("t", "replica:1", "none", 4 << 20, 8, now_ns=time.time_ns()),
                               TOKEN)
        yield m


class As:
    """A MetaClient of one credential, on its own pool."""

    def __init__(self, meta: LocalMetanode, pool: RpcPool, **kwargs: object) -> None:
        self.pool = pool
        self.mc = MetaClient(pool, [meta.addr], deadline=5.0, **kwargs)
        self.addr = meta.addr

    async def code(self, message: C.Command | Q.Query, token: str | None = None) -> str:
        if isinstance(message, C.Command):
            return await code(self.mc.mutate(message, token=token))
        return await code(self.mc.query(message))


async def _open(meta: LocalMetanode, credential: Credential, nursery: trio.Nursery, **kwargs: object) -> As:
    pool = RpcPool(secret=credential)
    await nursery.start(_run_pool, pool)
    return As(meta, pool, **kwargs)


async def _run_pool(pool: RpcPool, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with pool:
        task_status.started()
        await trio.sleep_forever()


async def test_a_client_credential_reaches_only_its_own_volumes(meta: LocalMetanode, nursery) -> None:
    job = await _open(meta, cred("client", "job", "a"), nursery)
    info = await job.mc.mutate(C.MountVolume("a"))
    d = await job.mc.mutate(C.Mkdir("a", 1, b"d", 0o755))
    assert (await job.mc.query(Q.GetAttr("a", d.ino))).ino == d.ino
    sid = await job.mc.mutate(C.AllocSlices(1))
    f = await job.mc.mutate(C.Mknod("a", 1, b"f", 0o100644))
    assert (await job.mc.mutate(C.WriteSlice("a", f.ino, 0, sid, 0, 10, 0, 1))).size == 10
    assert await job.mc.query(Q.ReadChunk("a", f.ino, 0))

    applied, b_inodes = meta.state.applied_index, len(meta.state.volumes["b"].inodes)
    other = [Q.GetAttr("b", 1), Q.Lookup("b", 1, b"x"), Q.ReadDir("b", 1), Q.StatFs("b"), Q.ReadChunk("b", 1, 0),
             Q.GetUsage("b", 1), Q.ListXattr("b", 1), Q.Open("b", f.ino, info.session),
             C.MountVolume("b"), C.Mkdir("b", 1, b"x", 0o755), C.Mknod("b", 1, b"x", 0o100644),
             C.SetAttr("b", 1, mode=0o777), C.WriteSlice("b", 1, 0, sid, 0, 10, 0, 1), C.Unlink("b", 1, b"x"),
             C.SetXattr("b", 1, b"user.x", b"v"), C.CompactChunk("b", 1, 0, (sid, 0, 10, 0), sid, 10),
             C.Rename("a", 1, b"d", 1, b"d", new_volume="b")]
    assert {type(m).__name__: await job.code(m) for m in other} == {type(m).__name__: "EACCES" for m in other}
    assert meta.state.applied_index == applied and len(meta.state.volumes["b"].inodes) == b_inodes

    # What speaks of every volume shows it its own only.
    assert set(await job.mc.query(Q.ListVolumes())) == {"a"}
    cmap = await job.mc.query(Q.ClusterMap())
    assert set(cmap["volumes"]) == {"a"} and set(cmap["pgs"]) <= {"a"}
    admin = await _open(meta, cred("admin", "ops"), nursery)
    assert set(await admin.mc.query(Q.ListVolumes())) == {"a", "b", "t"}


async def test_administration_needs_an_admin_credential_and_the_cluster_map_a_server(
    meta: LocalMetanode, nursery
) -> None:
    job = await _open(meta, cred("client", "job", "a", "t"), nursery)
    admin = await _open(meta, cred("admin", "ops"), nursery)
    server = await _open(meta, Credential.server(SECRET, "datanode-1"), nursery)
    t_hash, applied = meta.state.volumes["t"].token_hash, meta.state.applied_index
    admin_work = [C.CreateVolume("c", "replica:1"), C.SetVolumeCompression("a", "zstd"),
                  C.SetVolumeAccess("t"), C.SetQuota("a", 1, max_inodes=10), Q.ListTrash("a"),
                  C.PurgeTrash("a", ()), C.RemoveNode("datanode", "dn1")]
    server_work = [C.RegisterNode("datanode", "dn1", "127.0.0.1:9", "z1", 1 << 30),
                   Q.NodeHeartbeat("datanode", "dn1", 1)]
    for m in admin_work + server_work:
        assert await job.code(m) == "EACCES", m  # a client reopens no volume, drops no node
    assert meta.state.volumes["t"].token_hash == t_hash and meta.state.applied_index == applied
    assert "c" not in meta.state.volumes

    for m in server_work:
        assert await admin.code(m) == "EACCES", m
        assert await server.code(m) == "OK", m
    got = {type(m).__name__: await admin.code(m) for m in admin_work}
    assert got == {type(m).__name__: "OK" for m in admin_work}
    assert "c" in meta.state.volumes and meta.state.volumes["t"].token_hash == ""  # reopened
    assert "dn1" not in meta.state.cluster.datanodes
    # An admin is confined to no volume and needs no token (it may set one).
    assert (await admin.mc.query(Q.GetAttr("b", 1))).ino == 1
    assert await admin.code(C.SetVolumeAccess("t"), token=TOKEN) == "OK"
    assert (await admin.mc.query(Q.GetAttr("t", 1))).ino == 1


async def test_sessions_belong_to_the_identity_that_mounted_them(meta: LocalMetanode, nursery) -> None:
    one = await _open(meta, cred("client", "one", "a"), nursery)
    two = await _open(meta, cred("client", "two", "a"), nursery)
    admin = await _open(meta, cred("admin", "ops"), nursery)
    mine = (await one.mc.mutate(C.MountVolume("a"))).session
    theirs = (await two.mc.mutate(C.MountVolume("a"))).session
    f = await one.mc.mutate(C.Mknod("a", 1, b"f", 0o100644))
    await one.mc.query(Q.Open("a", f.ino, mine))
    opens = set(meta.service.opens.by_session[mine])

    for m in (Q.SessionHeartbeat(mine), Q.SessionHeartbeat(mine, ()), Q.Open("a", f.ino, mine),
              Q.Release("a", f.ino, mine), C.CloseSession(mine)):
        assert await two.code(m) == "EACCES", m
    assert mine in meta.state.sessions and meta.service.opens.by_session[mine] == opens == {f.ino}

    assert await one.mc.query(Q.SessionHeartbeat(mine)) is True
    await one.mc.query(Q.Release("a", f.ino, mine))
    await one.mc.mutate(C.CloseSession(mine))
    await admin.mc.mutate(C.CloseSession(theirs))  # an admin may end anyone's
    assert not meta.state.sessions
    meta.check()


async def test_one_client_cannot_replay_or_collect_another_clients_answers(meta: LocalMetanode, nursery) -> None:
    one = await _open(meta, cred("client", "one", "a"), nursery)
    two = await _open(meta, cred("client", "two", "a"), nursery)

    async def mkdir(who: As, client_id: str, seq: int, name: bytes):
        a = C.Mkdir("a", 1, name, 0o755).to_request(client_id, seq)
        return C.Mkdir.REPLY((await who.pool.call(who.addr, "mkdir", {"a": a}, timeout=5)).result)

    first = await mkdir(one, "same", 1, b"one")
    assert await mkdir(one, "same", 1, b"one") == first  # its own retry: answered once
    # Another credential with the same client_id and seq is another client:
    # its command is applied, it does not get the first one's answer.
    second = await mkdir(two, "same", 1, b"two")
    assert second.ino != first.ino
    assert (await two.mc.query(Q.Lookup("a", 1, b"two"))).ino == second.ino
    # Naming the first one's stamped client_id does not make it the first one either.
    third = await mkdir(two, f"{Credential.issue(SECRET, 'client', 'one', ['a']).identity.tag}/same", 1, b"three")
    assert third.ino not in (first.ino, second.ino)
    with pytest.raises(CacheFSError) as info:
        await mkdir(two, "x" * 129, 1, b"four")
    assert info.value.errno == errno.EINVAL and "client_id" in str(info.value)


async def test_a_token_volume_needs_a_session_that_proved_the_token(meta: LocalMetanode, nursery) -> None:
    job = await _open(meta, cred("client", "job", "t"), nursery)
    peer = await _open(meta, cred("client", "peer", "t"), nursery)
    assert await job.code(Q.GetAttr("t", 1)) == "EACCES"
    assert await job.code(C.Mkdir("t", 1, b"d", 0o755)) == "EACCES"
    assert await job.code(C.MountVolume("t")) == "EACCES"
    assert await job.code(C.MountVolume("t"), token="wrong") == "EACCES"
    session = (await job.mc.mutate(C.MountVolume("t"), token=TOKEN)).session
    d = await job.mc.mutate(C.Mkdir("t", 1, b"d", 0o755))
    assert (await job.mc.query(Q.GetAttr("t", d.ino))).ino == d.ino
    # The grant is the session's identity's, not the volume credential's.
    assert await peer.code(Q.GetAttr("t", d.ino)) == "EACCES"
    # It survives a restart from a snapshot (sessions are replicated state) ...
    restored = MetaState()
    restored.restore(meta.state.snapshot())
    assert restored.session_counts == meta.state.session_counts
    # ... and ends with the session.
    await job.mc.mutate(C.CloseSession(session))
    assert await job.code(Q.GetAttr("t", d.ino)) == "EACCES"
    meta.check()


async def test_a_metadata_dump_and_load_need_an_admin_credential(meta: LocalMetanode, nursery) -> None:
    job = await _open(meta, cred("client", "job", "a"), nursery)
    admin = await _open(meta, cred("admin", "ops"), nursery)
    dump = {"a": Q.DumpVolume("a").to_wire()}
    assert await code(job.mc.call("dump_volume", dump)) == "EACCES"  # not even its own volume
    assert await code(job.mc.call("restore_volume", {}, payload=b"x")) == "EACCES"
    reply = await admin.mc.call("dump_volume", dump, full=True)
    assert bytes(reply.payload).startswith(backup.MAGIC) and reply.result == len(reply.payload)
    # An admin may send one, but this cluster holds volumes: refused, naming them.
    with pytest.raises(CacheFSError, match=r"not empty \(volumes: a, b, t\)") as err:
        await admin.mc.call("restore_volume", {}, payload=bytes(reply.payload))
    assert err.value.code == "EEXIST"
