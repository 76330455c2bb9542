"""The big fio cases refuse to run on a disk too full for JuiceFS's cache to keep what it reads."""

import os
from pathlib import Path

import pytest

from bench import fio_compare as fc

GiB = 1 << 30


def test_the_room_counts_working_sets_datanodes_caches_and_juicefs_floor() -> None:
    need = fc.room_needed(["big", "big4"], GiB, repeat=3, caches=[8 * GiB, 20 * GiB], disk_size=100 * GiB)
    # 2 x 4 GiB (local, passthrough) + 1.5 x 5 GiB x 2 rounds + 8 GiB + the 15 GiB a cache
    # of 20 GiB sees in 3 rounds + 10% of 100 GiB + 1 GiB
    assert need == 8 * GiB + 15 * GiB + 8 * GiB + 15 * GiB + 10 * GiB + GiB
    assert fc.room_needed([], GiB, 3, [8 * GiB], 100 * GiB) == 0


def test_a_disk_with_too_little_room_is_refused_naming_both_sizes(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    fc.check_room(tmp_path, free // 2)
    with pytest.raises(SystemExit, match=r"GiB free; the big cases need .* GiB"):
        fc.check_room(tmp_path, free + 100 * GiB)
