"""``cachefs info PATH``: inode, slices, blocks, shard holders and cached copies,
checked against the lab's own files (each shard a file under its datanode's
directory) and against what the mount's stat says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

MiB = 1 << 20


def cachefs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cachefs.cli", *args], capture_output=True, text=True, timeout=120)


def _blocks(info: dict) -> list[dict]:
    return [b for c in info["chunks"] for s in c["slices"] for b in s["blocks"]]


def test_info_names_every_block_where_its_shards_are_and_which_cache_node_holds_it(small_lab, small_mnt) -> None:
    client = str(small_lab.credential_file("client"))
    (small_mnt / "info").mkdir(exist_ok=True)
    path = small_mnt / "info" / "nine.bin"
    path.write_bytes(os.urandom(9 * MiB))  # 3 blocks of 4 MiB, one slice
    meta = ",".join(small_lab.meta_addrs)
    warm = cachefs("warmup", "--volume", "lab", "--meta", meta, "--secret-file", client, "--quiet", "/info/nine.bin")
    assert warm.returncode == 0, warm.stderr

    r = cachefs("info", str(path), "--json", "--secret-file", client)  # inside the mount: no --meta, no --volume
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["volume"], info["path"], info["type"]) == ("lab", "/info/nine.bin", "file")
    assert info["inode"] == os.stat(path).st_ino and info["size"] == 9 * MiB
    assert info["policy"].startswith("ec:2+1") and info["block_size"] == 4 * MiB
    blocks = _blocks(info)
    assert [b["index"] for b in blocks] == [0, 1, 2]
    datanodes = {n.name for n in small_lab.of_kind("datanode")}
    (cache,) = [n.name for n in small_lab.of_kind("cachenode")]
    for b in blocks:
        assert b["shards_held"] == 3
        holders = [sh["held_by"] for sh in b["shards"]]
        assert sorted(h for hs in holders for h in hs) == sorted(datanodes)  # one shard on each datanode
        for sh in b["shards"]:
            (node,) = sh["held_by"]
            assert sh["placed"] == node
            files = list((small_lab.root / node / "shards" / "lab").glob(f"*/{b['key']}.{sh['index']}"))
            assert len(files) == 1, (node, b["key"], sh["index"])
        assert b["cache_owners"] == [cache] and b["cached_on"] == [cache]

    # the same from outside the mount, with the admin credential
    admin = str(small_lab.credential_file("admin"))
    r = cachefs("info", "/info/nine.bin", "--volume", "lab", "--meta", meta, "--secret-file", admin, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == info
    r = cachefs("info", "/info/nine.bin", "--volume", "lab", "--meta", meta, "--secret-file", admin)
    assert r.returncode == 0 and f"inode {info['inode']}, file, size {9 * MiB}" in r.stdout, r.stdout
    assert r.stdout.count(f"cached on {cache}") == 3, r.stdout

    r = cachefs("info", str(small_mnt / "info"), "--json", "--secret-file", client)
    assert r.returncode == 0 and json.loads(r.stdout)["type"] == "directory", r.stderr
    r = cachefs("info", str(small_mnt / "info" / "absent"), "--secret-file", client)
    assert r.returncode == 1 and "/info/absent" in r.stderr, r.stderr
    r = cachefs("info", "/tmp", "--secret-file", client)
    assert r.returncode == 2 and "not inside a cachefs mount" in r.stderr, r.stderr
    path.unlink()


def test_a_cache_node_says_which_blocks_it_holds_without_fetching_them(small_lab, small_mnt) -> None:
    """``holds`` answers from the index: an absent block stays absent (no read-through)."""
    import trio

    from cachefs.ids import BlockKey
    from cachefs.rpc import RpcPool

    (node,) = small_lab.of_kind("cachenode")
    absent = BlockKey(1 << 40, 0).to_bytes()

    async def ask() -> tuple[list, list, str]:
        async with RpcPool(secret=small_lab.credential("admin")) as pool:
            first = (await pool.call(node.addr, "holds", {"volume": "lab", "keys": [absent]})).result
            again = (await pool.call(node.addr, "holds", {"volume": "lab", "keys": [absent]})).result
            try:
                await pool.call(node.addr, "holds", {"volume": "lab", "keys": [1, 2]})
            except Exception as exc:  # noqa: BLE001 - the error's text is what is checked
                return first, again, str(exc)
            return first, again, ""

    first, again, error = trio.run(ask)
    assert first == again == [False]
    assert "block keys" in error
