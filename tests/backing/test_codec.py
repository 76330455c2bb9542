"""The block codec: round trips, any M shards lost, range plans, corruption."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.backing.codec import BlockHeader, Codec
from cachefs.backing.policy import VolumePolicy
from cachefs.errors import Corrupt, Unavailable

POLICIES = ["ec:4+2", "ec:2+1", "ec:3+3", "replica:3", "replica:1"]

blocks = st.one_of(
    st.binary(max_size=3000),
    st.integers(0, 200_000).map(lambda n: os.urandom(n)),
    st.integers(0, 200_000).map(lambda n: bytes(n)),  # compressible
)


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    compression=st.sampled_from(["none", "zstd"]),
    data=blocks,
    choice=st.data(),
)
def test_round_trip_with_any_m_shards_lost(policy, compression, data, choice) -> None:
    codec = Codec(VolumePolicy.parse(policy, compression=compression))
    header, shards = codec.encode(data)
    assert len(shards) == codec.policy.n
    assert BlockHeader.unpack(header.pack()) == header
    assert all(len(s) == header.shard_size for s in shards)
    lost = choice.draw(st.sets(st.integers(0, codec.policy.n - 1), max_size=codec.policy.m))
    kept = {i: s for i, s in enumerate(shards) if i not in lost}
    assert codec.decode(header, kept) == data
    if compression == "zstd" and len(data) > 1000 and not any(data):
        assert header.compressed and header.stored_len < len(data)


@settings(max_examples=30, deadline=None)
@given(policy=st.sampled_from(POLICIES), data=blocks, choice=st.data())
def test_m_plus_one_lost_is_unavailable(policy, data, choice) -> None:
    codec = Codec(VolumePolicy.parse(policy))
    header, shards = codec.encode(data)
    lost = choice.draw(st.sets(st.integers(0, codec.policy.n - 1),
                               min_size=codec.policy.m + 1, max_size=codec.policy.m + 1))
    with pytest.raises(Unavailable):
        codec.decode(header, {i: s for i, s in enumerate(shards) if i not in lost})


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    size=st.integers(0, 300_000),
    offset=st.integers(0, 320_000),
    length=st.integers(-1, 320_000),
)
def test_range_plan_reads_only_covering_data_shards(policy, size, offset, length) -> None:
    codec = Codec(VolumePolicy.parse(policy))
    data = os.urandom(size)
    header, shards = codec.encode(data)
    assert codec.expected_header(size).frag_size == header.frag_size
    plan = codec.plan_range(header, offset, length)
    assert plan is not None
    assert all(r.index < codec.policy.k for r in plan)  # never parity
    got = b"".join(shards[r.index][r.offset : r.offset + r.length] for r in plan)
    want = data[offset:] if length == -1 else data[offset : offset + length]
    assert got == want


def test_compressed_blocks_must_be_read_whole() -> None:
    codec = Codec(VolumePolicy.parse("ec:4+2", compression="zstd"))
    header, _ = codec.encode(bytes(100_000))
    assert header.compressed and codec.plan_range(header, 10, 10) is None


def test_incompressible_data_is_stored_plain() -> None:
    codec = Codec(VolumePolicy.parse("ec:4+2", compression="zstd"))
    header, _ = codec.encode(os.urandom(50_000))
    assert not header.compressed


@pytest.mark.parametrize("policy", ["ec:4+2", "replica:3"])
def test_bit_flip_never_returns_wrong_bytes(policy) -> None:
    codec = Codec(VolumePolicy.parse(policy))
    data = os.urandom(100_000)
    header, shards = codec.encode(data)
    bad = bytearray(shards[0])
    bad[-7] ^= 1
    with pytest.raises(Corrupt):
        codec.decode(header, {0: bad, **{i: s for i, s in enumerate(shards) if i != 0}})


def test_header_mismatch_and_garbage() -> None:
    codec = Codec(VolumePolicy.parse("ec:4+2"))
    other, shards = Codec(VolumePolicy.parse("ec:2+1")).encode(b"abc")
    with pytest.raises(Corrupt, match="volume is ec:4\\+2"):
        codec.decode(other, dict(enumerate(shards)))
    with pytest.raises(Corrupt):
        BlockHeader.unpack(b"x" * len(other.pack()))


@settings(max_examples=25, deadline=None)
@given(policy=st.sampled_from(POLICIES), data=blocks, choice=st.data())
def test_rebuild_recreates_lost_shards_exactly(policy, data, choice) -> None:
    codec = Codec(VolumePolicy.parse(policy, compression="zstd"))
    if codec.policy.m == 0:
        return  # nothing can be lost and rebuilt
    header, shards = codec.encode(data)
    lost = sorted(choice.draw(st.sets(st.integers(0, codec.policy.n - 1), min_size=1,
                                      max_size=codec.policy.m)))
    kept = {i: s for i, s in enumerate(shards) if i not in lost}
    assert codec.rebuild(header, kept, lost) == {i: shards[i] for i in lost}
