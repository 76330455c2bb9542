"""The zones as one cache tier: a working set between one zone's capacity and
the tier's, read twice from one zone, is found in the tier the second time."""

from __future__ import annotations

from bench.tier_bench import MiB, measure
from cachefs.cachenode.peers import PEEK_PATIENCE, PEEK_SAMPLE, PeerZones
from cachefs.ids import BlockKey

from .blockserver import cache_setup


def test_second_pass_over_two_zones_worth_of_blocks_hits_the_tier(tmp_path) -> None:
    result = measure(capacity=32 * MiB, ratio=1.6, workdir=str(tmp_path))
    # Without the other zone, z1's node cycles through the set with LRU: no hits at all.
    assert result["tier_hit_rate_two_zone_working_set"] >= 0.9, result
    held = result["blocks_held_per_node"]
    assert all(n > 0 for n in held.values()) and sum(held.values()) >= result["blocks"], result


async def test_a_peer_that_keeps_missing_is_asked_only_now_and_then(tmp_path) -> None:
    """A cold read must not pay a peek per block for nothing: after
    PEEK_PATIENCE misses in a row the next zone's owner is asked on one miss
    in PEEK_SAMPLE; a block placed there makes it asked every time again."""
    async with cache_setup(tmp_path, {}) as peer:  # the next zone's owner, a real cache node
        cmap = {"cachenodes": [
            {"id": "self", "addr": "127.0.0.1:9", "zone": "z1", "capacity": 64 * MiB},
            {"id": "peer", "addr": peer.addr, "zone": "z2", "capacity": 64 * MiB, "used": 0},
        ]}  # fmt: skip

        async def cluster_map() -> dict:
            return cmap

        zones = PeerZones(peer.pool, "z1", "self", cluster_map)
        zones.update(cmap)
        asked = peer.service.counters
        for i in range(PEEK_PATIENCE + 4 * PEEK_SAMPLE):  # blocks no zone holds
            assert await zones.get("v", BlockKey(800, i)) is None
        assert asked.peeks_missed == PEEK_PATIENCE + 4
        assert zones.stats["peeks_skipped"] == 4 * PEEK_SAMPLE - 4

        key = BlockKey(801, 0)
        assert await zones.place("v", key, b"y" * 5000)
        assert bytes(await zones.get("v", key)) == b"y" * 5000
        for i in range(3):
            assert await zones.get("v", BlockKey(802, i)) is None
        assert asked.peeks_missed == PEEK_PATIENCE + 4 + 3  # asked every time again
