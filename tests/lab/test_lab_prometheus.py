"""``cachefs lab up --prometheus``: a real Prometheus scrapes every node and the
mount; after a workload its HTTP API answers the hit-rate and op-latency queries,
as the dashboard's panels (docs/grafana/cachefs.json) ask them, and it evaluates
the alert rules of docs/prometheus."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

import pytest
import yaml

from cachefs.lab.cluster import VOLUME, Lab, LabConfig, _alive
from cachefs.testing.ports import free_lab_base

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "cachefs.json"
RULES = Path(__file__).resolve().parents[2] / "docs" / "prometheus" / "cachefs-rules.yml"
pytestmark = [pytest.mark.needs_fuse,
              pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")]


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(port: int, expr: str, timeout: float = 60, *, label: tuple[str, str] | None = None) -> list[dict]:
    """The answer to ``expr`` once it has a series (one with ``label``, a name and value, if given)."""
    deadline = time.monotonic() + timeout
    while not (result := query(port, expr)) or (
            label and not any(r["metric"].get(label[0]) == label[1] for r in result)):
        assert time.monotonic() < deadline, f"prometheus has no {expr} ({label}): {result}"
        time.sleep(0.5)
    return result


def rules(port: int) -> dict[str, dict]:
    """The alerting rules Prometheus loaded, by name, with their last evaluation."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules?type=alert", timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return {r["name"]: r for group in body["data"]["groups"] for r in group["rules"]}


def panel(title: str) -> list[str]:
    """The queries of the dashboard's panel ``title``."""
    [found] = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == title]
    return [target["expr"] for target in found["targets"]]


def test_lab_prometheus_scrapes_every_node_and_the_mount(needs_fuse, tmp_path: Path) -> None:
    config = LabConfig(root=str(tmp_path / "lab"), metanodes=1, datanodes=3, cachenodes=2, zones=3,
                       policy="ec:2+1", data_capacity="2G", cache_capacity="256M", cache_memory="16M",
                       mount_cache="64M", prometheus=True)
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=120)
        state = json.loads((tmp_path / "lab" / "lab.json").read_text())
        port = state["prometheus_port"]
        assert state["prometheus_pid"] and state["mount_metrics_port"]
        mnt = tmp_path / "mnt"
        # An L1 of two blocks for a file of three: every read reaches the cache tier for some block.
        lab.mount(str(mnt), "--l1-size", "8M", l2=False)
        assert wait_for(port, 'count(up{job=~"cachefs-.*"} == 1) == ' + str(len(lab.nodes) + 1))
        data = os.urandom(12 << 20)  # three blocks of the lab volume's 4 MiB
        (mnt / "f").write_bytes(data)

        def read() -> None:
            with open(mnt / "f", "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                assert f.read() == data

        read()
        reads = wait_for(port, 'cachefs_mount_op_latency_seconds_count{op="read"} > 0')
        assert reads[0]["metric"]["zone"] == "z1"
        read()  # after a first sample, so the series has a rate; the cache tier now holds what it filled
        [p99] = panel("FUSE op latency p99 by op")
        wait_for(port, f"{p99} > 0", label=("op", "read"))
        [heatmap] = panel("FUSE op latency (all ops)")
        assert wait_for(port, heatmap)
        # The cache tier's series, per zone: every zone with a cache node, and a hit rate
        # in the mount's zone (its second read found there what its first one filled).
        tier = wait_for(port, "sum by (zone) (cachefs_cache_hits_total) + sum by (zone) (cachefs_cache_misses_total)")
        assert {r["metric"]["zone"] for r in tier} == {n.zone for n in lab.of_kind("cachenode")}
        [hit_rate] = panel("Cache tier hit rate per zone")
        rates = wait_for(port, f"{hit_rate} > 0", label=("zone", "z1"))
        assert all(0 < float(r["value"][1]) <= 1 for r in rates), rates
        l1_rate, _sources = panel("Mount: L1 hit rate and where blocks came from")
        [rate] = wait_for(port, f"{l1_rate} >= 0")
        assert 0 <= float(rate["value"][1]) <= 1
        # The write path and the metanode's namespace on its real disk.
        assert wait_for(port, f"cachefs_mount_write_bytes_total >= {len(data)}")
        assert wait_for(port, "cachefs_mount_commit_latency_seconds_count > 0")
        assert wait_for(port, 'cachefs_metanode_dentries{volume="' + VOLUME + '"} >= 1')
        disk = wait_for(port, "cachefs_metanode_metadata_bytes > 0")
        assert {r["metric"]["part"] for r in disk} >= {"wal"}
        assert wait_for(port, 'cachefs_datanode_shard_io_seconds_count{op="put"} > 0')
        # The alert rules of docs/prometheus, evaluated on the lab's series: all of them, without
        # error, and a healthy lab fires none of the critical ones.
        alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
        loaded = rules(port)
        assert set(loaded) == alerts and all(r["health"] == "ok" for r in loaded.values()), loaded
        assert all(loaded[a]["state"] == "inactive" for a in ("CachefsMetanodeLeaderLost", "CachefsZoneDown"))
        pid = state["prometheus_pid"]
    finally:
        lab.down()
    assert not _alive(pid)
