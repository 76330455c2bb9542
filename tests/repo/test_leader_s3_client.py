"""The metanode leader makes its S3 clients off its trio loop.

Making boto3's first client (imports, service model) took the leader's loop
about 4.5 s at load ~20: no Raft heartbeat, no answer to anyone. Here the
real service lists a lazily linked SeaweedFS bucket on a first read, and
the making of that link's client is held (boto3's own ``Session.client``,
made to wait) until the same leader has answered another request: held on
the loop, the answer never comes and the hold runs out.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.rpc import RpcPool
from cachefs.testing.metanode import local_metanode
from cachefs.testing.s3server import SeaweedS3

HOLD = 15.0  # seconds the client's making waits for the other answer


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with SeaweedS3(tmp_path_factory.mktemp("weed")) as server:
        yield server


async def test_the_leader_answers_while_a_links_first_s3_client_is_made(
    s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    setup = boto3.session.Session().client("s3", endpoint_url=s3.endpoint)
    setup.create_bucket(Bucket="held")
    for key in ("a.bin", "b.bin", "sub/c.bin"):
        setup.put_object(Bucket="held", Key=key, Body=key.encode())

    making, answered = threading.Event(), threading.Event()
    held: list[bool] = []  # per client made for our endpoint: was the other request answered meanwhile
    real = boto3.session.Session.client

    def client(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("endpoint_url") == s3.endpoint:
            making.set()
            held.append(answered.wait(HOLD))
        return real(self, *args, **kwargs)

    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.create_volume("v")
        mc = meta.client(pool)
        d = await mc.mutate(C.Mkdir("v", 1, b"lazy", 0o755, 0, 0))
        await mc.mutate(C.LinkRepo("v", d.ino, "held", "", s3.endpoint, "", "lazy"))
        monkeypatch.setattr(boto3.session.Session, "client", client)
        listed: list[bytes] = []

        async def first_read() -> None:  # lists the link's directory: the leader's first client for it
            listed.extend(e.name for e in await mc.query(Q.ReadDir("v", d.ino, 0, 100)))

        with trio.fail_after(HOLD + 30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(first_read)
                while not making.is_set():
                    await trio.sleep(0.01)  # on the loop: this too waits if the loop is held
                attr = await mc.query(Q.GetAttr("v", 1))
                answered.set()
        assert attr.ino == 1
        assert held == [True], "the leader's loop was held while its S3 client was made"
        assert sorted(listed) == [b"a.bin", b"b.bin", b"sub"]
