"""Every RPC method of every daemon (real processes), called with typed
arguments at the edges, with a client credential and with none (issue 14, item 10).

The methods and their argument types come from the services' own
signatures (the same ones the servers check against), so a new method is
fuzzed without touching this file. Hypothesis builds each argument from its
type, pushed to the edges (huge and negative ints, empty and 5,000-character
strings, 4 KiB bytes, nested containers) or, now and then, of a wrong type.

What must hold after each batch: the daemon still answers, every call a
client's credential does not cover (a method outside its role, another
volume) was refused with EACCES before the handler ran, an unauthenticated
call was refused with the connection, and a batch in which every call was
refused changed no state.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing

import pytest
import trio
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from cachefs import wire
from cachefs.credentials import ANYONE, CLIENT, Credential
from cachefs.errors import CacheFSError, PermissionDenied
from cachefs.rpc import Method, RpcPool
from tests.rpc.rawpeer import RawPeer

VOLUME = "lab"  # the client credential's one volume (the lab's)
REFUSED = {"EACCES", "EINVAL", "ENOSYS"}  # answered before any handler ran


def served_methods(kind: str) -> dict[str, Method]:
    """The methods a daemon of ``kind`` serves, read from its service classes."""
    from cachefs.cachenode.service import CacheService
    from cachefs.datanode.service import DatanodeService
    from cachefs.metanode.raft.driver import RaftNode
    from cachefs.metanode.service import MetaService
    from cachefs.transport.rdma import RdmaResponder

    classes = {"metanode": [MetaService, RaftNode], "datanode": [DatanodeService],
               "cachenode": [CacheService, RdmaResponder]}[kind]
    out = {"health": Method("health", lambda: None, roles=ANYONE)}
    for cls in classes:
        for attr in dir(cls):
            fn = getattr(cls, attr, None)
            name = getattr(fn, "__rpc_name__", None)
            if name is not None:
                out[name] = Method(name, fn)
    return out


EDGE_INTS = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]),
                      st.integers(-(2**63), 2**64 - 1))
EDGE_STRS = st.one_of(st.sampled_from(["", VOLUME, "other", "x" * 5000, "../../etc/passwd", "a\x00b", "é" * 30,
                                       "ec:9999+9999", "replica:0", "datanode", "cachenode"]),
                      st.text(max_size=16))
EDGE_BYTES = st.one_of(st.sampled_from([b"", bytes(12), b"\xff" * 12, b"\x00" * 4096, b"\x90", b"\xc1"]),
                       st.binary(max_size=32))
scalar = st.one_of(st.none(), st.booleans(), EDGE_INTS, st.floats(), EDGE_STRS, EDGE_BYTES)
nested = st.recursive(scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                      max_leaves=10)
BY_TYPE = {int: EDGE_INTS, str: EDGE_STRS, bytes: EDGE_BYTES, bool: st.booleans(), float: st.floats(),
           list: st.lists(nested, max_size=6), dict: st.dictionaries(st.text(max_size=8), nested, max_size=4),
           type(None): st.none()}


def typed(types: tuple[type, ...] | None) -> st.SearchStrategy:
    if types is None:
        return nested
    right = st.one_of(*[BY_TYPE[t] for t in dict.fromkeys(types)])
    return st.one_of(right, right, right, nested)  # a wrong type about one time in four


@st.composite
def calls(draw, methods: dict[str, Method]):
    name = draw(st.sampled_from(sorted(methods)))
    method = methods[name]
    args = {}
    for param in method.params.values():
        if param.required or draw(st.booleans()):
            args[param.name] = draw(typed(param.types))
    if draw(st.integers(0, 9)) == 0:
        args["zzz"] = draw(nested)
    payload = draw(st.one_of(st.none(), st.none(), st.binary(min_size=1, max_size=64)))
    return name, args, payload


def expected_refusal(method: Method, args: dict) -> str | None:
    """What the RPC layer must answer a client credential for ``VOLUME`` before any handler runs."""
    if CLIENT not in method.roles:
        return "EACCES"
    try:
        method.check(args)
    except CacheFSError:
        return "EINVAL"
    volume = args.get("volume")
    if method.names_volume and isinstance(volume, str) and volume != VOLUME:
        return "EACCES"
    return None


async def _call_unauthenticated(addr: str, name: str, args: dict, payload: bytes | None) -> str:
    peer = await RawPeer.connect(addr)
    try:
        with trio.fail_after(5):
            assert isinstance(await peer.read(), wire.Hello)
            await peer.send(wire.Request(1, name, args, 1000, payload=payload))
            reply = await peer.read()
            # Not a handshake (EPROTO), or over the handshake's frame size (EMSGSIZE).
            assert isinstance(reply, wire.ErrorReply) and reply.code in ("EPROTO", "EMSGSIZE"), reply
            assert await peer.read() is None  # and the connection is closed
    finally:
        await peer.aclose()
    return reply.code


async def _fingerprint(pool: RpcPool, kind: str, addr: str):
    if kind == "metanode":
        status = (await pool.call(addr, "meta_status", timeout=10)).result
        return status["applied_index"]
    stats = (await pool.call(addr, "stats", timeout=10)).result
    return (stats.get("used"), stats.get("blocks"), stats.get("shards"))


@pytest.mark.parametrize("kind", ["metanode", "datanode", "cachenode"])
def test_every_method_with_typed_edge_arguments_and_a_client_credential_or_none(small_lab, kind: str) -> None:
    node = small_lab.of_kind(kind)[0]
    methods = served_methods(kind)
    assert {"set_volume_access", "remove_node", "purge_trash"} <= set(methods) or kind != "metanode"
    assert {"rdma_connect", "rdma_get"} <= set(methods) or kind != "cachenode"
    client = Credential.issue(small_lab.secret, "client", "fuzz", [VOLUME])
    optional = {name for name in methods if name.startswith("rdma_")}

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.lists(st.tuples(calls(methods), st.booleans()), min_size=1, max_size=8))
    def run(batch):
        async def scenario():
            async with RpcPool(secret=small_lab.secret) as root, RpcPool(secret=client) as pool:
                before = await _fingerprint(root, kind, node.addr)
                codes = []
                for (name, args, payload), authenticated in batch:
                    if not authenticated:
                        codes.append(await _call_unauthenticated(node.addr, name, args, payload))
                        continue
                    try:
                        await pool.call(node.addr, name, args, payload=payload, timeout=10)
                        code = "OK"
                    except CacheFSError as exc:
                        code = exc.code
                    want = expected_refusal(methods[name], args)
                    if code == "ENOSYS" and name in optional:
                        pass  # RDMA is served only where a device exists
                    elif want == "EACCES":
                        assert code == "EACCES", (name, args, code)
                    elif want == "EINVAL":
                        assert code == "EINVAL", (name, args, code)
                    codes.append(code)
                assert (await root.call(node.addr, "health", timeout=10)).result["service"] == kind
                if all(c in REFUSED | {"EPROTO", "EMSGSIZE"} for c in codes):
                    assert await _fingerprint(root, kind, node.addr) == before, (batch, codes)

        trio.run(scenario)

    run()
    assert node.pid and os.waitpid(node.pid, os.WNOHANG) == (0, 0)  # the lab's process, alive


def _client_messages_naming_a_volume() -> list[type]:
    from cachefs import commands as C
    from cachefs import queries as Q

    return sorted((cls for cls in [*C.REQUESTS.values(), *Q.QUERIES.values()]
                   if CLIENT in cls.ROLES and "volume" in {f.name for f in dataclasses.fields(cls)}),
                  key=lambda cls: cls.NAME)


def _of_type(hint) -> st.SearchStrategy:
    """Values of a command field's type: at the edges that go over the wire,
    or small enough (ints) and clean enough (names) to pass validation."""
    if hint is int:
        return st.one_of(EDGE_INTS, st.integers(0, 1 << 16))
    if hint is bytes:
        return st.one_of(EDGE_BYTES, st.binary(min_size=1, max_size=16).filter(lambda b: not {0, 47} & set(b)))
    if hint in BY_TYPE:
        return BY_TYPE[hint]
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return st.one_of(*[_of_type(a) for a in args])
    if typing.get_origin(hint) is tuple:
        return st.lists(_of_type(args[0]), max_size=4).map(tuple)
    return st.from_type(hint)


@st.composite
def well_formed_on_another_volume(draw):
    """A command or query a client may send, well formed (it decodes and
    validates), naming a volume the client's credential does not hold."""
    from cachefs import commands as C

    cls = draw(st.sampled_from(_client_messages_naming_a_volume()))
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in ("client_id", "seq", "now_ns"):
            continue
        if f.name in ("volume", "new_volume"):
            kwargs[f.name] = draw(st.sampled_from(["other", "lab-other", "x" * 64]))
        elif f.default is dataclasses.MISSING or draw(st.booleans()):
            kwargs[f.name] = draw(_of_type(hints[f.name]))
    try:
        message = cls(**kwargs)
    except CacheFSError:
        reject()
    if isinstance(message, C.Command):
        return cls.NAME, list(message.to_request(draw(EDGE_STRS.filter(lambda s: len(s) <= 128)), 1))
    return cls.NAME, list(message.to_wire())


def test_well_formed_metanode_calls_on_another_volume_are_refused_and_change_nothing(small_lab) -> None:
    """The generic fuzzer's lists mostly fail to decode; these decode, so they
    reach the volume check after it (service._admit)."""
    node = small_lab.of_kind("metanode")[0]
    client = Credential.issue(small_lab.secret, "client", "fuzz", [VOLUME])

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.lists(well_formed_on_another_volume(), min_size=1, max_size=8))
    def run(batch):
        async def scenario():
            async with RpcPool(secret=small_lab.secret) as root, RpcPool(secret=client) as pool:
                before = await _fingerprint(root, "metanode", node.addr)
                for name, a in batch:
                    with pytest.raises(PermissionDenied, match="has no credential for volume"):
                        await pool.call(node.addr, name, {"a": a}, timeout=10)
                assert await _fingerprint(root, "metanode", node.addr) == before, batch

        trio.run(scenario)

    run()
