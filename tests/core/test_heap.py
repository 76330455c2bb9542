"""cachefs.heap: when the trimmer trims, and what the tracer reports."""

from __future__ import annotations

import pytest

from cachefs.heap import HeapTrimmer, MemoryTracer


@pytest.fixture
def resident() -> list[int]:
    return [100 << 20]


def test_the_trimmer_waits_for_slack_or_its_period(resident, monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("cachefs.heap.time.monotonic", lambda: clock[0])
    trimmer = HeapTrimmer(slack=32 << 20, period=10.0, resident=lambda: resident[0])
    if not trimmer.available:
        pytest.skip("no malloc_trim in this libc")
    resident[0] += 31 << 20
    clock[0] = 1.0
    assert not trimmer.check()
    resident[0] += 1 << 20  # 32 MiB above the floor
    assert trimmer.check() and trimmer.trims == 1
    clock[0] = 5.0
    assert not trimmer.check()  # the floor is now the resident size after that trim
    clock[0] = 11.0
    assert trimmer.check() and trimmer.trims == 2  # the period passed


def test_the_tracer_reports_what_grew_between_steps() -> None:
    tracer = MemoryTracer()
    try:
        assert "started" in tracer.step()
        tracer.step()
        kept = [bytearray(1 << 20) for _ in range(4)]
        report = tracer.step()
        grew = report.split("grew most since the last report")[1].split("largest")[0]
        assert "test_heap.py" in grew.splitlines()[1], report
        del kept
    finally:
        import tracemalloc

        tracemalloc.stop()
