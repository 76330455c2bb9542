"""``cachefs stats MOUNTPOINT``: a live per-second view of one mount, like ``juicefs stats``.

It reads ``MOUNTPOINT/.cachefs/stats`` (client/control.py: the mount's own
collector in the Prometheus text format, the numbers /metrics serves) every
interval and prints the differences: FUSE ops by kind and their latency,
bytes read and written, the share of bytes read from L1 and L2, where block
fetches went (the cache tier or backing storage), and the RPCs the mount
made with their round trip. The file works with ``--no-metrics`` and needs no
port, so one source of truth serves both.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from prometheus_client.parser import text_string_to_metric_families

STATS_FILE = (".cachefs", "stats")
TOP_OPS = 4  # ops by kind shown in the table (--json has all)


@dataclass
class Sample:
    """The counters of one read of the stats file, summed as the view needs them."""

    at: float
    values: dict[str, float] = field(default_factory=dict)  # "name" or "name|label" -> value

    def get(self, key: str) -> float:
        return self.values.get(key, 0.0)

    def keyed(self, prefix: str) -> dict[str, float]:
        return {k.split("|", 1)[1]: v for k, v in self.values.items() if k.startswith(prefix + "|")}


def parse(text: str, at: float) -> Sample:
    sample = Sample(at)
    v = sample.values
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels = s.name, s.labels
            if name == "cachefs_mount_op_latency_seconds_count":
                v[f"ops|{labels['op']}"] = s.value
            elif name == "cachefs_mount_op_latency_seconds_sum":
                v[f"ops_seconds|{labels['op']}"] = s.value
            elif name == "cachefs_mount_op_errors_total":
                v["errors"] = v.get("errors", 0.0) + s.value
            elif name == "cachefs_mount_rpc_latency_seconds_count":
                v[f"rpc|{labels['method']}"] = s.value
            elif name == "cachefs_mount_rpc_latency_seconds_sum":
                v[f"rpc_seconds|{labels['method']}"] = s.value
            elif name == "cachefs_mount_blocks_total":
                v[f"blocks|{labels['what']}"] = s.value
            elif not labels:
                v[name] = s.value
    return sample


def read_sample(mountpoint: Path) -> Sample:
    """One read of the stats file.

    Raises:
        click.ClickException: ``mountpoint`` is not a cachefs mount.
    """
    path = mountpoint.joinpath(*STATS_FILE)
    try:
        text = path.read_text()
    except OSError as exc:
        raise click.ClickException(
            f"{mountpoint} is not a cachefs mount (cannot read {path}: {exc.strerror or exc})"
        ) from None
    return parse(text, time.monotonic())


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def view(before: Sample, after: Sample) -> dict[str, Any]:
    """Rates over the interval between two samples (the ``--json`` record)."""
    dt = max(after.at - before.at, 1e-9)

    def delta(key: str) -> float:
        return max(after.get(key) - before.get(key), 0.0)

    def per_key(prefix: str) -> tuple[dict[str, float], dict[str, float]]:
        counts = {k: delta(f"{prefix}|{k}") for k in after.keyed(prefix)}
        seconds = {k: delta(f"{prefix}_seconds|{k}") for k in counts}
        return {k: c for k, c in counts.items() if c}, seconds

    ops, op_seconds = per_key("ops")
    rpcs, rpc_seconds = per_key("rpc")
    read = delta("cachefs_mount_read_bytes_total")
    cache, backing = delta("blocks|cache_reads"), delta("blocks|backing_reads")
    n_ops, n_rpcs = sum(ops.values()), sum(rpcs.values())
    return {
        "interval": round(dt, 3),
        "ops_per_s": round(n_ops / dt, 1),
        "ops": {k: round(c / dt, 1) for k, c in sorted(ops.items(), key=lambda kv: -kv[1])},
        "op_latency_ms": _ms(sum(op_seconds.values()), n_ops),
        "op_latency_ms_by_op": {k: _ms(op_seconds[k], c) for k, c in ops.items()},
        "errors_per_s": round(delta("errors") / dt, 1),
        "read_bytes_per_s": round(read / dt),
        "write_bytes_per_s": round(delta("cachefs_mount_write_bytes_total") / dt),
        "l1_hit_ratio": _round(_ratio(delta("cachefs_mount_read_l1_hit_bytes_total"), read)),
        "l2_hit_ratio": _round(_ratio(delta("cachefs_mount_l2_hit_bytes_total"), read)),
        "cache_hit_ratio": _round(_ratio(cache, cache + backing)),
        "backing_ratio": _round(_ratio(backing, cache + backing)),
        "block_fetches_per_s": round((cache + backing) / dt, 1),
        "rpc_per_s": round(n_rpcs / dt, 1),
        "rpc_latency_ms": _ms(sum(rpc_seconds.values()), n_rpcs),
        "rpc": {k: {"per_s": round(c / dt, 1), "latency_ms": _ms(rpc_seconds[k], c)} for k, c in rpcs.items()},
        "dirty_bytes": after.get("cachefs_mount_dirty_bytes"),
    }


def _ms(seconds: float, count: float) -> float | None:
    return round(seconds / count * 1000, 3) if count else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


HEADER = (f"{'ops/s':>8} {'lat ms':>7} {'read/s':>9} {'write/s':>9} {'l1':>5} {'l2':>5} {'cache':>5} "
          f"{'backing':>7} {'rpc/s':>7} {'rpc ms':>7}  top ops")


def _size(n: float) -> str:
    unit = "B"
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            break
        n /= 1024
    return f"{n:.0f}B" if unit == "B" else f"{n:.1f}{unit}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def line(v: dict[str, Any]) -> str:
    top = " ".join(f"{op}:{rate:g}" for op, rate in list(v["ops"].items())[:TOP_OPS])
    return (f"{v['ops_per_s']:>8g} {_num(v['op_latency_ms']):>7} {_size(v['read_bytes_per_s']):>9} "
            f"{_size(v['write_bytes_per_s']):>9} {_pct(v['l1_hit_ratio']):>5} {_pct(v['l2_hit_ratio']):>5} "
            f"{_pct(v['cache_hit_ratio']):>5} {_pct(v['backing_ratio']):>7} {v['rpc_per_s']:>7g} "
            f"{_num(v['rpc_latency_ms']):>7}  {top}")


@click.command(name="stats")
@click.argument("mountpoint", type=click.Path(file_okay=False, path_type=Path))
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between samples.")
@click.option("--count", type=click.IntRange(min=0), default=0, show_default=True,
              help="Samples to print, then exit (0: until interrupted).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per sample (rates per second).")
def command(mountpoint: Path, interval: float, count: int, as_json: bool) -> None:
    """Show a mount's activity every INTERVAL seconds: ops by kind, bytes,
    L1 / L2 / cache-tier / backing hit rates and RPC latency."""
    if not os.path.ismount(mountpoint):
        raise click.ClickException(f"{mountpoint} is not a mount point")
    before = read_sample(mountpoint)
    shown = 0
    try:
        while not count or shown < count:
            time.sleep(max(0.0, before.at + interval - time.monotonic()))
            after = read_sample(mountpoint)
            v = view(before, after)
            if as_json:
                click.echo(json.dumps(v))
            else:
                if shown % 20 == 0:
                    click.echo(HEADER)
                click.echo(line(v))
            before = after
            shown += 1
    except KeyboardInterrupt:
        pass
