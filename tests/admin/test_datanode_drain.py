"""``cachefs datanode drain`` / ``remove`` on a lab of real processes (4
datanodes in 3 zones, ec:2+1): once a datanode is drained it holds no
shard and no placement group names it, so with it killed (and a second
datanode too, which ec:2+1 survives only if the drained one's shards moved)
every file reads back identical; then it can be removed from the map."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachefs import queries as Q
from cachefs.rpc import RpcPool

pytestmark = [pytest.mark.slow, pytest.mark.needs_fuse]

MiB = 1 << 20


@pytest.fixture(scope="module")
def lab(needs_fuse, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from cachefs.testing.labs import running_lab

    with running_lab(tmp_path_factory.mktemp("drainlab"), datanodes=4) as lab:
        yield lab


def datanode_cli(lab: Any, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachefs.cli", "datanode", *args, "--meta", ",".join(lab.meta_addrs),
            "--secret-file", str(lab.credential_file("admin"))]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def cluster_map(lab: Any) -> dict[str, Any]:
    async def ask() -> dict[str, Any]:
        async with RpcPool(secret=lab.credential("admin")) as pool:
            return await lab.meta_client(pool, deadline=10).query(Q.ClusterMap())

    return lab.run(ask)


def shards(lab: Any, name: str) -> int:
    from cachefs.datanode.drain import shards_on

    async def ask() -> int:
        async with RpcPool(secret=lab.credential("admin")) as pool:
            return await shards_on(pool, lab.node(name).addr, ["lab"])

    return lab.run(ask)


def test_a_drained_datanode_can_be_killed_with_another_and_every_file_reads_back(lab) -> None:
    # first what is refused (nothing is stored yet, so the placement changes move nothing)
    r = datanode_cli(lab, "drain", "nowhere:1")
    assert r.returncode == 1 and "no datanode 'nowhere:1'" in r.stderr, r.stderr
    assert datanode_cli(lab, "drain", "data1", "--json").returncode == 0
    r = datanode_cli(lab, "drain", "data2")
    assert r.returncode == 1 and "would leave 2 datanodes" in r.stderr and "needs 3" in r.stderr, r.stderr
    r = datanode_cli(lab, "drain", "data1", "--undo", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["draining"] is False, r.stdout + r.stderr
    assert any("data1" in pg for pg in cluster_map(lab)["pgs"]["lab"])
    r = datanode_cli(lab, "remove", "data1")
    assert r.returncode == 1 and "is not drained" in r.stderr, r.stderr

    mnt = Path(tempfile.mkdtemp(prefix="cachefs-drain-mnt-"))
    rng = random.Random(3)
    files = {f"big{i}": rng.randbytes(4 * MiB + i * 1000) for i in range(8)}
    files |= {f"small{i}": rng.randbytes(100_000 + i) for i in range(20)}
    lab.mount(str(mnt), l2=False)
    try:
        (mnt / "drain").mkdir()
        for name, data in files.items():
            with open(mnt / "drain" / name, "wb") as f:
                f.write(data)
                os.fsync(f.fileno())
        before = shards(lab, "data4")
        assert before > 0  # some placement groups name it: losing it and data2 would lose their blocks

        r = datanode_cli(lab, "drain", lab.node("data4").addr, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        out = json.loads(r.stdout)
        assert (out["node"], out["state"], out["shards_left"], out["errors"]) == ("data4", "drained", 0, [])
        assert out["shards_moved"] >= before and out["passes"] >= 1
        assert shards(lab, "data4") == 0
        cmap = cluster_map(lab)
        assert all("data4" not in pg for pg in cmap["pgs"]["lab"])
        assert {n["id"]: n["draining"] for n in cmap["datanodes"]} == {"data1": False, "data2": False,
                                                                       "data3": False, "data4": True}  # fmt: skip

        r = datanode_cli(lab, "remove", "data4")
        assert r.returncode == 1 and "still answers" in r.stderr, r.stderr  # stop it first
        lab.kill("data4")
        lab.kill("data2")  # ec:2+1 loses one more: only data1 and data3 are left
        subprocess.run([sys.executable, "-m", "cachefs.cli", "warmup", "--volume", "lab", "--quiet", "--evict",
                        "/drain", "--meta", ",".join(lab.meta_addrs), "--secret-file",
                        str(lab.credential_file("client"))], check=True, capture_output=True, timeout=120)  # fmt: skip
        lab.umount()  # a fresh mount: no L1, no page cache
        lab.mount(str(mnt), l2=False)
        for name, data in files.items():
            assert (mnt / "drain" / name).read_bytes() == data, name

        r = datanode_cli(lab, "remove", lab.node("data4").addr)
        assert r.returncode == 0 and "datanode data4" in r.stdout and "removed" in r.stdout, r.stdout + r.stderr
        assert "data4" not in {n["id"] for n in cluster_map(lab)["datanodes"]}
    finally:
        lab.umount()
        if not os.path.ismount(mnt):
            mnt.rmdir()

