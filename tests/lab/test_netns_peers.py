"""The zones as one cache tier, on network namespaces: the blocks one zone
holds for the other are served from there, and when that zone is cut off
reads go on from backing storage (cachefs.cachenode.peers)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from cachefs.lab.cluster import Lab, LabConfig
from cachefs.rpc import RpcPool

from .test_netns_lab import _why_not, lab_leftovers

pytestmark = [pytest.mark.slow, pytest.mark.needs_fuse]

MiB = 1 << 20
SUBNET = "10.254.7.0/24"  # not the default: the zone-cut test may run a lab beside this one


def _stats(lab: Lab, names: tuple[str, ...] = ("cache1", "cache2")) -> dict[str, dict]:
    async def get() -> dict[str, dict]:
        async with RpcPool(secret=lab.secret) as pool:
            return {n: (await pool.call(lab.node(n).addr, "stats", timeout=10)).result for n in names}

    return lab.run(get)


def _read_sha(path: Path) -> str:
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _fetches(before: dict[str, dict], after: dict[str, dict]) -> int:
    return sum(after[n]["backing_fetches"] - before[n]["backing_fetches"] for n in before)


def test_blocks_held_by_the_other_zone_and_that_zone_cut_off(tmp_path: Path) -> None:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    mnt = tmp_path / "mnt"
    lab = Lab(LabConfig(root=str(tmp_path / "lab"), netns=SUBNET, metanodes=1, datanodes=3, cachenodes=2,
                        zones=2, policy="ec:2+1", cache_capacity="32M", cache_memory="0",
                        data_capacity="2G", metrics=False))  # fmt: skip
    prefix = None
    passed = False
    try:
        lab.up(timeout=90)
        prefix = lab.network.prefix
        lab.mount(str(mnt), "--l1-size", "0", "--readahead", "4M", l2=False)  # every read asks the tier
        deadline = time.monotonic() + 30
        while any(s["peer_zones"] < 1 for s in _stats(lab).values()):
            assert time.monotonic() < deadline, "the cache nodes never saw each other's zone"
            time.sleep(0.2)
        data = os.urandom(48 * MiB)  # 12 blocks: 1.5 times one zone's 32 MiB
        (mnt / "ws").write_bytes(data)
        want = hashlib.sha256(data).hexdigest()
        assert _read_sha(mnt / "ws") == want  # pass 1: z1 fills, the overflow goes to z2
        held = {n: s["blocks"] for n, s in _stats(lab).items()}
        assert held["cache2"] > 0 and sum(held.values()) >= 12, held

        before = _stats(lab)
        assert _read_sha(mnt / "ws") == want  # pass 2: all of it from the tier
        after = _stats(lab)
        assert _fetches(before, after) == 0
        assert after["cache1"]["peer_hits"] - before["cache1"]["peer_hits"] >= held["cache2"] - 1

        # z2's cache node cut off: its blocks come from backing storage, nothing fails.
        assert lab.network.cut("cache2") == ["cache2"]
        started = time.monotonic()
        assert _read_sha(mnt / "ws") == want
        took = time.monotonic() - started
        cut = _stats(lab, ("cache1",))
        assert cut["cache1"]["peer_errors"] > after["cache1"]["peer_errors"]
        assert cut["cache1"]["backing_fetches"] > after["cache1"]["backing_fetches"]
        assert took < 60, f"reads with z2 cut off took {took:.1f}s"
        assert lab.network.heal() == ["cache2"]
        assert _read_sha(mnt / "ws") == want
        passed = True
    finally:
        lab.down(wipe=passed)
    assert not os.path.ismount(mnt)
    assert prefix and lab_leftovers(prefix) == []
