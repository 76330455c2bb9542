"""The inline-or-thread policy of L2's small reads (sans-IO)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachefs.client.inline_reads import InlineReads


def test_fast_reads_stay_inline_and_slow_ones_move_to_threads_and_back() -> None:
    pace = InlineReads(stall_max=0.001, weight=0.5)
    for _ in range(20):
        pace.observe(0.0001)
    assert pace.inline and pace.mean == pytest.approx(0.0001, rel=1e-3)
    pace.observe(0.01)  # one stall of 10 ms: the mean passes 1 ms
    assert not pace.inline
    pace.observe(0.0008)  # below the limit but not below half of it: stays in threads
    pace.observe(0.0008)
    assert not pace.inline and pace.mean > 0.0005
    for _ in range(3):
        pace.observe(0.0001)
    assert pace.inline


def test_a_limit_of_zero_never_reads_inline() -> None:
    pace = InlineReads(stall_max=0.0)
    assert not pace.inline
    for _ in range(10):
        pace.observe(0.0)
    assert not pace.inline


@pytest.mark.parametrize("kwargs", [{"stall_max": -1.0}, {"weight": 0.0}, {"weight": 1.5}])
def test_a_bad_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="bad inline read policy"):
        InlineReads(**kwargs)


@given(st.lists(st.floats(min_value=0.0, max_value=1.0), max_size=200))
def test_the_decision_follows_the_mean(times: list[float]) -> None:
    """Whatever the read times: the mean stays within them, inline never goes
    on with a mean past the limit, nor threads with one below half of it."""
    pace = InlineReads(stall_max=0.001)
    for seconds in times:
        pace.observe(seconds)
        assert 0.0 <= pace.mean <= max(times)
        if pace.inline:
            assert pace.mean <= pace.stall_max
        else:
            assert pace.mean >= pace.stall_max / 2
