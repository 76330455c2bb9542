"""Volume policy parsing and placement-group properties."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.backing.placement import pg_of, place_pgs
from cachefs.backing.policy import VolumePolicy
from cachefs.errors import InvalidArgument
from cachefs.ids import BlockKey


def test_parse_policies() -> None:
    ec = VolumePolicy.parse("ec:4+2", compression="zstd")
    assert (ec.kind, ec.k, ec.m, ec.n, ec.write_quorum, ec.compressed) == ("ec", 4, 2, 6, 5, True)
    assert str(ec) == "ec:4+2"
    rep = VolumePolicy.parse(" Replica:3 ")
    assert (rep.kind, rep.k, rep.m, rep.n, rep.write_quorum) == ("replica", 1, 2, 3, 2)
    assert VolumePolicy.parse("ec:2+1").write_quorum == 3
    assert VolumePolicy.parse("replica:1").write_quorum == 1
    vol = VolumePolicy.from_volume({"policy": "ec:2+1", "compression": "none", "block_size": 1 << 20})
    assert vol.block_size == 1 << 20


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("ec:4", "expected 'ec:K\\+M'"),
        ("ec:0+2", "at least 1"),
        ("ec:30+3", "at most 32"),
        ("replica:0", "between 1"),
        ("raid5", "bad policy"),
        ("", "bad policy"),
    ],
)
def test_bad_policies_name_the_problem(text: str, fragment: str) -> None:
    with pytest.raises(InvalidArgument, match=fragment):
        VolumePolicy.parse(text)


def test_bad_compression_and_block_size() -> None:
    with pytest.raises(InvalidArgument, match="compression"):
        VolumePolicy.parse("ec:4+2", compression="lz4")
    with pytest.raises(InvalidArgument, match="block size"):
        VolumePolicy.parse("ec:4+2", block_size=10)


def test_pg_of_is_stable_and_spread() -> None:
    counts = Counter(pg_of(BlockKey(s, i), 16) for s in range(200) for i in range(8))
    assert set(counts) == set(range(16))
    assert max(counts.values()) < 2.0 * (1600 / 16)
    assert pg_of(BlockKey(7, 3), 64) == pg_of(BlockKey(7, 3).to_bytes(), 64)


clusters = st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=5).map(
    lambda sizes: [
        (f"dn-{z}-{i}", f"zone-{z}", 1.0) for z, size in enumerate(sizes) for i in range(size)
    ]
)


def _expected_zone_counts(nodes, width):
    sizes = Counter(zone for _, zone, _ in nodes)
    # Water-filling: the most even spread the layout allows.
    quotas = dict.fromkeys(sizes, 0)
    left = width
    while left:
        for zone in sorted(sizes):
            if left and quotas[zone] < sizes[zone]:
                quotas[zone] += 1
                left -= 1
    return sorted(quotas.values())


@settings(max_examples=60, deadline=None)
@given(nodes=clusters, width=st.integers(min_value=1, max_value=9), pg_count=st.integers(1, 40))
def test_distinct_nodes_and_even_zone_spread(nodes, width, pg_count) -> None:
    if width > len(nodes):
        with pytest.raises(InvalidArgument, match="at least"):
            place_pgs(nodes, pg_count, width)
        return
    zone_of = {n: z for n, z, _ in nodes}
    pgs = place_pgs(nodes, pg_count, width)
    assert len(pgs) == pg_count
    expected = _expected_zone_counts(nodes, width)
    for pg in pgs:
        assert len(pg) == width and len(set(pg)) == width
        counts = Counter(zone_of[n] for n in pg)
        spread = sorted(counts.get(z, 0) for z in set(zone_of.values()))
        assert spread == expected
    assert place_pgs(list(reversed(nodes)), pg_count, width) == pgs  # order independent


def _moved(before, after) -> int:
    return sum(a != b for old, new in zip(before, after, strict=True) for a, b in zip(old, new, strict=True))


@settings(max_examples=40, deadline=None)
@given(nodes=clusters, width=st.integers(1, 6), data=st.data())
def test_one_join_or_leave_moves_close_to_the_minimum(nodes, width, data) -> None:
    pg_count = 64
    if width > len(nodes) - 1:
        return
    before = place_pgs(nodes, pg_count, width)
    # Leave: at least every slot the leaver held must move; allow a little
    # more only where zone quotas shift.
    leaver = data.draw(st.sampled_from([n for n, _, _ in nodes]))
    after = place_pgs([n for n in nodes if n[0] != leaver], pg_count, width, previous=before)
    held = sum(pg.count(leaver) for pg in before)
    assert _moved(before, after) <= held + pg_count // 8 + 1
    for old, new in zip(before, after, strict=True):
        for a, b in zip(old, new, strict=True):
            assert a == b or a == leaver or b not in old  # survivors keep their slot
    # Join: every moved slot should go to the newcomer (minimum), up to quota shifts.
    zone = data.draw(st.sampled_from(sorted({z for _, z, _ in nodes}) + ["zone-new"]))
    joined = [*nodes, ("dn-new", zone, 1.0)]
    after = place_pgs(joined, pg_count, width, previous=before)
    gained = sum(pg.count("dn-new") for pg in after)
    assert _moved(before, after) <= gained + pg_count // 8 + 1


def test_weights_shift_load() -> None:
    nodes = [("a", "z", 1.0), ("b", "z", 1.0), ("c", "z", 4.0)]
    load = Counter(n for pg in place_pgs(nodes, 600, 1) for n in pg)
    assert load["c"] > 2 * load["a"] and load["c"] > 2 * load["b"]


def test_bad_nodes() -> None:
    with pytest.raises(InvalidArgument, match="twice"):
        place_pgs([("a", "z", 1.0), ("a", "y", 1.0)], 4, 1)
    with pytest.raises(InvalidArgument, match="weight"):
        place_pgs([("a", "z", 0.0)], 4, 1)
