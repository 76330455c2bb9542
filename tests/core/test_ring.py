"""Routing properties of cachefs.ring: consistent hashing per zone, weights, down marks."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.ids import BlockKey
from cachefs.ring import CacheNodeInfo, CacheRouter, ZoneRing

KEYS = [BlockKey(s, i) for s in range(1, 501) for i in range(8)]  # 4000 keys


def _node(i: int, zone: str = "a", capacity: int = 1 << 30, state: str = "up") -> dict:
    return {
        "id": f"n{i}",
        "addr": f"127.0.0.1:{7000 + i}",
        "zone": zone,
        "capacity": capacity,
        "state": state,
    }


def _owners(nodes: list[dict]) -> dict[BlockKey, str]:
    ring = ZoneRing(CacheNodeInfo.from_map(n) for n in nodes)
    return {k: ring.owner(k).id for k in KEYS}


@settings(max_examples=15, deadline=None)
@given(n=st.integers(min_value=2, max_value=12))
def test_adding_one_node_moves_about_one_nth_and_only_to_it(n: int) -> None:
    before = _owners([_node(i) for i in range(n)])
    after = _owners([_node(i) for i in range(n + 1)])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == f"n{n}" for k in moved)
    expected = len(KEYS) / (n + 1)
    assert 0.5 * expected <= len(moved) <= 1.6 * expected


@settings(max_examples=15, deadline=None)
@given(n=st.integers(min_value=3, max_value=12), data=st.data())
def test_removing_one_node_moves_only_its_keys(n: int, data: st.DataObject) -> None:
    gone = data.draw(st.integers(min_value=0, max_value=n - 1))
    before = _owners([_node(i) for i in range(n)])
    after = _owners([_node(i) for i in range(n) if i != gone])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert {before[k] for k in moved} <= {f"n{gone}"}
    assert len(moved) == sum(1 for k in KEYS if before[k] == f"n{gone}")
    expected = len(KEYS) / n
    assert 0.5 * expected <= len(moved) <= 1.6 * expected


@settings(max_examples=15, deadline=None)
@given(caps=st.lists(st.sampled_from([1, 2, 3, 4]), min_size=2, max_size=8))
def test_keys_spread_by_capacity(caps: list[int]) -> None:
    nodes = [_node(i, capacity=c << 30) for i, c in enumerate(caps)]
    counts = Counter(_owners(nodes).values())
    total = sum(caps)
    for i, c in enumerate(caps):
        share = counts[f"n{i}"] / len(KEYS)
        assert abs(share - c / total) <= 0.35 * (c / total) + 0.01, (caps, counts)


def _two_zone_map(epoch: int = 1) -> dict:
    nodes = [_node(i, "a") for i in range(3)] + [_node(10 + i, "b") for i in range(3)]
    return {"epoch": epoch, "cachenodes": nodes}


def test_candidates_own_zone_first_then_other_zone() -> None:
    router = CacheRouter(_two_zone_map(), "b")
    zone_of = {n["addr"]: n["zone"] for n in _two_zone_map()["cachenodes"]}
    for key in KEYS[:200]:
        cands = router.candidates(key)
        assert [zone_of[a] for a in cands] == ["b", "a"]
    # a zone with no cache nodes of its own still gets every zone's owner
    assert len(CacheRouter(_two_zone_map(), "c").candidates(KEYS[0])) == 2


def test_mark_down_backs_off_then_returns() -> None:
    now = [100.0]
    router = CacheRouter(_two_zone_map(), "a", back_off=5.0, clock=lambda: now[0])
    key = KEYS[7]
    first, second = router.candidates(key)
    router.mark_down(first)
    assert router.candidates(key) == [second]
    now[0] += 5.1
    assert router.candidates(key) == [first, second]
    router.mark_down(first)  # second strike: twice as long
    now[0] += 5.1
    assert router.candidates(key) == [second]
    now[0] += 5.0
    assert router.candidates(key) == [first, second]
    now[0] += 200.0  # healthy for longer than max_back_off: strikes are forgotten
    router.mark_down(first)
    now[0] += 5.1
    assert router.candidates(key) == [first, second]
    router.mark_down(first)
    router.mark_down(second)
    assert router.candidates(key) == []  # caller goes to backing storage
    router.mark_up(first)
    assert router.candidates(key) == [first]


def test_update_rebuilds_on_change_and_drops_down_nodes() -> None:
    cmap = _two_zone_map()
    router = CacheRouter(cmap, "a")
    assert not router.update(_two_zone_map(epoch=1))
    owner = router.candidates(KEYS[3])[0]
    changed = _two_zone_map(epoch=2)
    for n in changed["cachenodes"]:
        if n["addr"] == owner:
            n["state"] = "down"
    assert router.update(changed)
    cands = router.candidates(KEYS[3])
    assert owner not in cands and len(cands) == 2
    assert router.epoch == 2
