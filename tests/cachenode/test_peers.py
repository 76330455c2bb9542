"""The zones as one cache tier: a working set between one zone's capacity and
the tier's, read twice from one zone, is found in the tier the second time."""

from __future__ import annotations

from bench.tier_bench import MiB, measure


def test_second_pass_over_two_zones_worth_of_blocks_hits_the_tier(tmp_path) -> None:
    result = measure(capacity=32 * MiB, ratio=1.6, workdir=str(tmp_path))
    # Without the other zone, z1's node cycles through the set with LRU: no hits at all.
    assert result["tier_hit_rate_two_zone_working_set"] >= 0.9, result
    held = result["blocks_held_per_node"]
    assert all(n > 0 for n in held.values()) and sum(held.values()) >= result["blocks"], result
