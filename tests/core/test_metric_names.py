"""Every metric of every daemon kind follows Prometheus naming: a cachefs_ prefix,
help text, base units as the last word (_bytes, _seconds), _total on counters
only, one unit per metric (no label value that is a unit), bounded labels."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import trio
from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

from cachefs import commands as C
from cachefs.client.mount import MountCollector
from cachefs.client.volume import ClientOptions, Volume
from cachefs.opstats import OpStats
from cachefs.rpc import RpcPool
from cachefs.testing.metanode import LocalMetanode, local_metanode

NOT_BASE_UNITS = re.compile(r"_(ms|us|ns|milliseconds|microseconds|kb|mb|gb|kib|mib|gib|percent|minutes|hours)(_|$)")
UNITS = ("bytes", "seconds")
# Labels whose values grow without bound (one series per file or block) are not metrics.
UNBOUNDED_LABELS = {"path", "inode", "ino", "file", "key", "block", "client", "client_id", "session", "uid"}


def daemon_families(metanode: LocalMetanode) -> list[Metric]:
    import cachefs.cachenode.daemon  # noqa: F401
    import cachefs.cli.repair  # noqa: F401  (each daemon's module registers its metrics)
    import cachefs.datanode.daemon  # noqa: F401
    import cachefs.metanode.daemon  # noqa: F401
    from cachefs.metanode.stats import NAMESPACE

    NAMESPACE.service = metanode.service
    try:
        return [m for m in REGISTRY.collect() if m.name.startswith("cachefs_")]
    finally:
        NAMESPACE.service = None


async def all_families(tmp_path: Path) -> list[Metric]:
    async with local_metanode() as metanode, RpcPool(secret=None) as pool, trio.open_nursery() as nursery:
        await metanode.create_volume("v")
        calls = pool.time_calls()
        session = await metanode.session(pool, "v")
        d = await session.mutate(C.Mkdir("v", 1, b"d", 0o755))
        await session.mutate(C.Mkdir("v", d.ino, b"e", 0o755))
        engine = Volume(session, ClientOptions(cache_dir=str(tmp_path / "l2"), cache_size=64 << 20),
                        nursery=nursery)
        assert engine.l2 is not None

        async def no_kernel(lost: object) -> None:  # what the FUSE front end drops from the kernel's caches
            del lost

        session.enable_leases(nursery, no_kernel)  # as the FUSE front end does: the lease families too
        ops = OpStats()
        ops.observe("read", 0.001)
        ops.error("lookup", errno.ENOENT)
        families = list(MountCollector(engine, ops, calls).collect()) + daemon_families(metanode)
        nursery.cancel_scope.cancel()
        await session.close()
    return families


def problems(family: Metric) -> list[str]:
    name, kind = family.name, family.type
    out = []
    if not family.documentation.strip():
        out.append("no help text")
    if NOT_BASE_UNITS.search(name):
        out.append("not in base units")
    if kind == "counter":
        if not all(s.name.endswith(("_total", "_created")) for s in family.samples):
            out.append("a counter sample without _total")
    elif name.endswith("_total"):
        out.append(f"a {kind} named _total")
    for unit in UNITS:
        if f"_{unit}_" in name + "_" and not name.endswith(f"_{unit}"):
            out.append(f"{unit} is not the last word")
    if kind == "histogram" and "latency" in name and not name.endswith("_seconds"):
        out.append("a latency not in _seconds")
    for sample in family.samples:
        for label, value in sample.labels.items():
            if label in UNBOUNDED_LABELS:
                out.append(f"unbounded label {label}")
            if label not in ("le", "quantile") and any(value == u or value.endswith(f"_{u}") for u in UNITS):
                out.append(f"label {label}={value} mixes units in one metric")
    return sorted(set(out))


async def test_every_metric_of_every_kind_follows_the_naming_rules(tmp_path: Path) -> None:
    families = await all_families(tmp_path)
    names = {f.name for f in families}
    for expected in ("cachefs_mount_l1_capacity_bytes", "cachefs_mount_read_bytes", "cachefs_raft_term",
                     "cachefs_datanode_corrupt_shards_found", "cachefs_cache_hits", "cachefs_rpc_latency_seconds",
                     "cachefs_mount_op_latency_seconds", "cachefs_mount_op_errors", "cachefs_cache_used_bytes",
                     "cachefs_cache_capacity_bytes", "cachefs_raft_role", "cachefs_datanode_used_bytes",
                     "cachefs_datanode_capacity_bytes", "cachefs_metanode_inodes", "cachefs_metanode_sessions",
                     "cachefs_metanode_volume_used_bytes", "cachefs_metanode_open_files",
                     "cachefs_metanode_dentries", "cachefs_metanode_leases", "cachefs_metanode_lease_events",
                     "cachefs_mount_write_bytes", "cachefs_mount_commit_latency_seconds",
                     "cachefs_mount_readahead_used_blocks", "cachefs_cache_evictions", "cachefs_cache_admissions",
                     "cachefs_cache_fill_seconds", "cachefs_datanode_shard_io_seconds",
                     "cachefs_datanode_scrubbed_shards", "cachefs_repair_progress_ratio",
                     "cachefs_raft_wal_sync_seconds", "cachefs_raft_proposals_per_append",
                     "cachefs_mount_rpc_latency_seconds", "cachefs_mount_leases_held",
                     "cachefs_mount_lease_events", "cachefs_mount_dirty_bytes", "cachefs_mount_l2_hit_bytes",
                     "cachefs_metanode_metadata_bytes", "cachefs_datanode_scrubbed_bytes",
                     "cachefs_blocks_under_replicated", "cachefs_mount_task_failures"):
        assert expected in names, expected
    values = {(s.name, tuple(s.labels.values())): s.value for f in families for s in f.samples}
    assert values[("cachefs_metanode_inodes", ("v",))] == 3  # the root, d and d/e
    assert values[("cachefs_metanode_dentries", ("v",))] == 2
    assert any(n == "cachefs_mount_rpc_latency_seconds_count" and v > 0 for (n, _), v in values.items())
    assert values[("cachefs_metanode_sessions", ())] == 1  # the mount's
    assert values[("cachefs_mount_op_errors_total", ("lookup", "ENOENT"))] == 1
    bad = {f.name: p for f in families if (p := problems(f))}
    assert not bad, bad


def test_the_rules_catch_what_the_old_names_did_wrong() -> None:
    """The names issue 18 listed, as they were, fail the rules."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    reads = CounterMetricFamily("cachefs_mount_read", "Read path counters", labels=["what"])
    reads.add_metric(["bytes"], 1)
    reads.add_metric(["block_fetches"], 1)
    assert problems(reads) == ["label what=bytes mixes units in one metric"]
    corrupt = GaugeMetricFamily("cachefs_datanode_corrupt_shards_found_total", "running count", value=1)
    assert problems(corrupt) == ["a gauge named _total"]
    assert problems(GaugeMetricFamily("cachefs_x_ms", "", value=1)) == ["no help text", "not in base units"]
