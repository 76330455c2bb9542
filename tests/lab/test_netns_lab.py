"""The lab on network namespaces, end to end: a zone cut off under reads and writes.

Real daemons, each in its own network namespace on the lab bridge, a real
FUSE mount (in the client namespace, zone z1) and fio with crc32c
verification. Zone z1 (meta1, data1, data4, cache1, cache4) is cut off while
files are read and written, then healed; every acknowledged byte must read
back intact, before, during and after. Everything the test creates
(processes, mount, namespaces, links) is removed afterwards and checked gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio

from cachefs.errors import CacheFSError
from cachefs.lab import netns
from cachefs.lab.cluster import Lab, LabConfig
from cachefs.queries import ClusterMap
from cachefs.rpc import RpcPool

pytestmark = [pytest.mark.slow, pytest.mark.needs_fuse]

CUT_ZONE = "z1"  # the client's own zone: its first cache ring, a metanode and 2 of 6 shards
# The metanodes' --node-timeout in the zone-cut lab (default 15 s): the cut outlasts it, so
# the map shows the zone's nodes down and then up again; the nodes heartbeat every second.
NODE_TIMEOUT = 8.0


def _why_not() -> str | None:
    reason = netns.netns_supported()
    if reason:
        return f"`ip netns` is not permitted here: {reason}"
    for tool in ("fio", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make setup installs it)"
    return None


def fio(mnt: Path, name: str, *, verify_only: bool = False, timeout: float = 90) -> subprocess.CompletedProcess:
    """2 x 12 MiB sequential writes with crc32c verification (or only the verification)."""
    argv = ["fio", f"--name={name}", f"--directory={mnt}", "--size=12M", "--bs=1M", "--numjobs=2",
            "--rw=write", "--verify=crc32c", "--do_verify=1", "--end_fsync=1", "--group_reporting",
            "--invalidate=1"]
    if verify_only:
        argv.append("--verify_only=1")
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def last_line(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1][:200] if lines else f"exit {result.returncode}"


def write_file(path: Path, size: int) -> str:
    data = os.urandom(size)
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def read_sha(path: Path) -> str:
    """Read through the mount, not the page cache (drops this file's cached pages first)."""
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        digest = hashlib.sha256()
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def running(pid: int) -> bool:
    """Alive and not a zombie (orphans of a killed `lab up` wait for init to reap them)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def lab_leftovers(prefix: str) -> list[str]:
    """Namespaces, links and nftables tables (the loss rules, in the root namespace) of a lab."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout if shutil.which(
        "nft") else ""
    return [n for n in names if n.startswith(prefix)] + [
        line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if f" {prefix}-" in line] + [
        line for line in tables.splitlines() if line.split()[-1:] == [prefix]]


def wait_all_up(lab: Lab, timeout: float) -> float:
    """Until the metanodes' cluster map shows every datanode and cache node up again."""
    async def poll() -> float:
        start = trio.current_time()
        async with RpcPool(secret=lab.secret) as pool:
            meta = lab.meta_client(pool, deadline=2.0)
            with trio.fail_after(timeout):
                while True:
                    try:
                        cmap = await meta.query(ClusterMap())
                    except CacheFSError:
                        cmap = None
                    if cmap and all(n["state"] == "up" for n in cmap["datanodes"] + cmap["cachenodes"]):
                        return trio.current_time() - start
                    await trio.sleep(0.5)

    return lab.run(poll)


def fio_until_ok(mnt: Path, name: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """The first fio write run that succeeds within ``timeout`` s (the client may still
    see the healed nodes as down for a while), and how long it took."""
    start = time.monotonic()
    attempt = 0
    while True:
        result = fio(mnt, f"{name}{attempt}")
        if result.returncode == 0 or time.monotonic() - start > timeout:
            return result, time.monotonic() - start
        attempt += 1
        time.sleep(1)


class Reader:
    """Reads and checks files through the mount in a loop on a thread, until stopped."""

    def __init__(self, files: dict[Path, str]) -> None:
        self.files = files
        self.errors: list[str] = []
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reader")

    def _run(self) -> None:
        while not self._stop.is_set():
            for path, sha in self.files.items():
                try:
                    if read_sha(path) != sha:
                        self.errors.append(f"{path.name}: wrong data")
                except OSError as exc:
                    self.errors.append(f"{path.name}: {exc.strerror}")
                self.done += 1

    def __enter__(self) -> Reader:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "a read through the mount hung for 2 minutes"


def test_zone_cut_under_reads_and_writes(tmp_path):
    """Phase 1: write and verify. Phase 2: one datanode and the client's zone's
    cache ring cut off under reads and writes: both go on. Phase 3: the whole
    zone z1 (a metanode too) cut off for longer than the metanodes' node
    timeout, under reads and writes. Then heal: the cluster map shows every
    node up, writes work, and every acknowledged byte reads back intact.

    Phase 3 is what the issue asks for: reads go on from the other zones,
    and writes go on since ec:4+2 over 3 zones survives a zone (the shards of
    z1's datanodes are handed off to the four left, two at most on each, and
    the metanodes' clients skip meta1). What failed there is asserted only
    after the heal checks, so a failure reports both.
    """
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    mnt = tmp_path / "mnt"
    lab = Lab(LabConfig(root=str(tmp_path / "lab"), netns=netns.DEFAULT_SUBNET, cache_capacity="512M",
                        cache_memory="16M", data_capacity="4G",
                        metanode_options=["--node-timeout", str(NODE_TIMEOUT)]))
    prefix = None
    timings: dict[str, float] = {}
    zone_cut_gaps: list[str] = []
    passed = False
    try:
        t0 = time.monotonic()
        lab.up(timeout=90)
        prefix = lab.network.prefix
        # A small L1 and readahead and no L2, so re-reads go to the cache tier and backing storage.
        lab.mount(str(mnt), "--l1-size", "4M", "--readahead", "4M", l2=False)
        timings["up+mount"] = time.monotonic() - t0
        addrs = {n.addr.rsplit(":", 1)[0] for n in lab.nodes}
        assert len(addrs) == len(lab.nodes) and all(a.startswith("10.254.0.") for a in addrs)

        # Phase 1: data written and verified, read once (so z1's cache nodes hold it).
        t0 = time.monotonic()
        first = fio(mnt, "before")
        assert first.returncode == 0, first.stdout + first.stderr
        files = {mnt / f"f{i}": write_file(mnt / f"f{i}", 6 << 20) for i in range(3)}
        assert {p: read_sha(p) for p in files} == files
        timings["phase 1"] = time.monotonic() - t0

        # Phase 2: data1 and z1's cache ring off the network, under reads and writes.
        t0 = time.monotonic()
        with Reader(files) as reader:
            time.sleep(0.3)
            for name in ("data1", "cache1", "cache4"):
                lab.network.cut(name)
            partial = fio(mnt, "partial")
            seen = reader.done
            time.sleep(1)
        assert partial.returncode == 0, partial.stdout + partial.stderr
        assert not reader.errors, reader.errors[:5]
        assert reader.done > seen > 0
        assert sorted(lab.network.heal()) == ["cache1", "cache4", "data1"]
        timings["phase 2"] = time.monotonic() - t0

        # Phase 3: the whole zone z1, longer than the metanodes' --node-timeout.
        t0 = time.monotonic()
        with Reader(files) as reader:
            time.sleep(0.3)
            cut = lab.network.cut(CUT_ZONE)
            assert sorted(cut) == ["cache1", "cache4", "data1", "data4", "meta1"]
            during = fio(mnt, "during", timeout=100)
            verify_during = fio(mnt, "before", verify_only=True)
            time.sleep(max(0.0, NODE_TIMEOUT + 5 - (time.monotonic() - t0)))
        timings["phase 3 (cut)"] = time.monotonic() - t0
        assert not [e for e in reader.errors if "wrong data" in e], reader.errors[:5]
        if reader.errors:
            zone_cut_gaps.append(f"{len(reader.errors)} of {reader.done} reads failed, e.g. {reader.errors[0]}")
        if verify_during.returncode != 0:
            zone_cut_gaps.append("fio could not re-read and verify the phase-1 files: "
                                 + last_line(verify_during))
        if during.returncode != 0:
            zone_cut_gaps.append("fio writes failed: " + last_line(during))

        # Heal: the map shows everything up, writes work, every acknowledged byte is intact.
        t0 = time.monotonic()
        assert sorted(lab.network.heal()) == sorted(cut)
        timings["map all up"] = wait_all_up(lab, timeout=40)
        after, timings["writes ok"] = fio_until_ok(mnt, "after", timeout=45)
        assert after.returncode == 0, after.stdout + after.stderr
        for name in ["before", "partial"] + (["during"] if during.returncode == 0 else []):
            again = fio(mnt, name, verify_only=True)
            assert again.returncode == 0, again.stdout + again.stderr
        assert {p: read_sha(p) for p in files} == files
        timings["heal+verify"] = time.monotonic() - t0
        passed = True
    finally:
        lab.down(wipe=passed)  # a failed run keeps its logs in tmp_path/lab/logs
    assert not os.path.ismount(mnt)
    assert prefix and lab_leftovers(prefix) == [], "lab down left namespaces or links behind"
    assert not (tmp_path / "lab").exists()
    print("timings:", {k: round(v, 1) for k, v in timings.items()})
    assert not zone_cut_gaps, "with zone z1 cut off (meta1, data1, data4, cache1, cache4): " + "; ".join(
        zone_cut_gaps)


def test_netns_lab_cleans_up_after_a_crash(tmp_path):
    """A network half-built by a crashed `lab up`: `destroy` finds all of it by its prefix."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    net = netns.Network.plan(tmp_path, netns.DEFAULT_SUBNET, [("a", "z1"), ("b", "z2"), ("c", "z2")])
    net.save()  # what create() writes before anything else
    subprocess.run(["ip", "link", "add", net.bridge, "type", "bridge"], check=True)
    subprocess.run(["ip", "netns", "add", net.endpoints[1].ns], check=True)
    subprocess.run(["ip", "link", "add", net.endpoints[1].veth, "type", "veth", "peer", "name", "eth0",
                    "netns", net.endpoints[1].ns], check=True)
    # ... crash. Nothing but the state file tells what exists.
    assert len(lab_leftovers(net.prefix)) == 3
    removed = netns.destroy(tmp_path)
    assert set(removed) >= {net.bridge, net.endpoints[1].ns}
    assert lab_leftovers(net.prefix) == []
    assert netns.Network.load(tmp_path) is None
    assert netns.destroy(tmp_path) == []  # idempotent


def test_lab_down_after_lab_up_was_killed(tmp_path):
    """`cachefs lab up --netns` killed -9 while starting: `cachefs lab down` still removes it all."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    root = tmp_path / "lab"
    cli = [sys.executable, "-m", "cachefs.cli", "lab"]
    up = subprocess.Popen([*cli, "up", "--netns", "--dir", str(root)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        pids: list[int] = []
        while time.monotonic() < deadline and len(pids) < 6:
            time.sleep(0.1)
            try:
                pids = [n["pid"] for n in json.loads((root / "lab.json").read_text())["nodes"] if n["pid"]]
            except (FileNotFoundError, json.JSONDecodeError):
                pass
        assert len(pids) >= 6, "lab up did not start its daemons"
    finally:
        up.kill()
        up.wait()
    prefix = netns.Network.load(root).prefix
    assert lab_leftovers(prefix)
    down = subprocess.run([*cli, "down", "--dir", str(root)], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert lab_leftovers(prefix) == []
    assert not [pid for pid in pids if running(pid)]
    assert not daemons_under(root)  # also any started after the last pid was recorded


def daemons_under(root: Path) -> list[int]:
    """Live cachefs processes with a path under ``root`` on their command line."""
    marker = f"{root}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if b"cachefs.cli" in argv and any(a.startswith(marker) for a in argv) and running(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_cut_and_heal_a_single_node(tmp_path):
    """Cut one node: only that address goes silent; heal brings it back; zones and names resolve."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    own_ns = os.readlink("/proc/thread-self/ns/net")
    net = netns.Network.plan(tmp_path, netns.DEFAULT_SUBNET, [("a", "z1"), ("b", "z2"), ("c", "z2")])
    try:
        net.create()
        assert [ep.name for ep in net.targets("z2")] == ["b", "c"]
        assert [ep.name for ep in net.targets("a")] == ["a"]

        def reachable() -> dict[str, bool]:
            import socket

            out = {}
            for ep in net.endpoints[1:]:
                with socket.socket() as s:
                    s.settimeout(0.5)
                    try:
                        s.connect((ep.ip, 9))
                    except ConnectionRefusedError:
                        out[ep.name] = True
                    except OSError:
                        out[ep.name] = False
            return out

        assert net.run_in(netns.CLIENT, reachable) == {"a": True, "b": True, "c": True}
        net.cut("b")
        assert net.run_in(netns.CLIENT, reachable) == {"a": True, "b": False, "c": True}
        assert netns.Network.load(tmp_path).cut_links == {"b": "link"}
        net.heal("b")
        # The client's ARP entry for b failed during the cut; give its retry a few seconds.
        deadline = time.monotonic() + 5
        while (seen := net.run_in(netns.CLIENT, reachable)) != {"a": True, "b": True, "c": True}:
            assert time.monotonic() < deadline, seen
        # The test process itself never entered a namespace.
        assert os.readlink("/proc/thread-self/ns/net") == own_ns
    finally:
        netns.destroy(tmp_path)
    assert lab_leftovers(net.prefix) == []


def test_zone_latency_with_netem(tmp_path):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    net = netns.Network.plan(tmp_path, netns.DEFAULT_SUBNET, [("a", "z1"), ("b", "z2")])
    try:
        net.create()
        try:
            net.set_latency("z2", "40ms")
        except netns.NetnsError as exc:
            if "sch_netem" in str(exc):
                pytest.skip(f"this kernel has no tc netem: {exc}")
            raise

        def rtt(ip: str) -> float:
            import socket

            start = time.monotonic()
            with socket.socket() as s:
                s.settimeout(2)
                try:
                    s.connect((ip, 9))
                except ConnectionRefusedError:
                    pass
            return time.monotonic() - start

        slow = net.run_in(netns.CLIENT, rtt, net.endpoint("b").ip)
        fast = net.run_in(netns.CLIENT, rtt, net.endpoint("a").ip)
        assert slow >= 0.04 > fast
        net.set_latency("z2", None)
        assert net.run_in(netns.CLIENT, rtt, net.endpoint("b").ip) < 0.04
    finally:
        netns.destroy(tmp_path)


def udp_socket(net: netns.Network, name: str) -> socket.socket:
    """A UDP socket made inside ``name``'s namespace (a socket stays in the namespace it was made
    in), bound to its address, with room for every datagram a test sends."""
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
        s.bind((net.endpoint(name).ip, 0))
        return s

    return net.run_in(name, make)


def delivered(src: socket.socket, dst: socket.socket, count: int) -> int:
    """Send ``count`` numbered datagrams from ``src`` to ``dst``; how many distinct ones arrive.

    Waits until all arrived, or until none has arrived for 0.5 s (bounded: 10 s in all)."""
    tag = os.urandom(4)
    for i in range(count):
        src.sendto(tag + i.to_bytes(4, "big"), dst.getsockname())
    got: set[int] = set()
    end = time.monotonic() + 10
    while len(got) < count and time.monotonic() < end:
        ready, _, _ = select.select([dst], [], [], 0.5)
        if not ready:
            break
        data = dst.recv(64)
        if data[:4] == tag:
            got.add(int.from_bytes(data[4:8], "big"))
    return len(got)


def test_packet_loss_drops_both_ways_and_heal_removes_it(tmp_path):
    """`lab loss 50 b`: about half the datagrams to and from b are lost (200 each way: the
    bounds 20%..80% are over 8 standard deviations wide), none to a; nftables counted the
    drops. `cut --how loss` loses all; heal restores all of them and leaves no table behind."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    reason = netns.loss_supported()
    if reason:
        pytest.skip(f"packet loss needs nftables: {reason}")
    net = netns.Network.plan(tmp_path, netns.DEFAULT_SUBNET, [("a", "z1"), ("b", "z2")])
    socks: list[socket.socket] = []
    try:
        net.create()
        client, a, b = (udp_socket(net, n) for n in (netns.CLIENT, "a", "b"))
        socks += [client, a, b]
        n = 200
        assert delivered(client, b, 20) == delivered(b, client, 20) == 20  # ARP resolved before the loss

        cli = [sys.executable, "-m", "cachefs.cli", "lab", "loss", "50", "b", "--dir", str(tmp_path)]
        done = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        net = netns.Network.load(tmp_path)
        assert net.loss == {"b": 50.0}
        to_b, from_b = delivered(client, b, n), delivered(b, client, n)
        assert 0.2 * n <= n - to_b <= 0.8 * n, f"{n - to_b} of {n} lost on the way to b"
        assert 0.2 * n <= n - from_b <= 0.8 * n, f"{n - from_b} of {n} lost on the way from b"
        assert delivered(client, a, n) == n  # a's link is not lossy
        assert net.dropped()["b"] >= 2 * n - to_b - from_b

        assert net.heal() == ["b"]
        assert net.loss == {} and net.dropped() == {}
        assert delivered(client, b, n) == delivered(b, client, n) == n
        assert lab_tables(net.prefix) == []

        assert net.cut("b", how="loss") == ["b"]
        assert delivered(client, b, 20) == delivered(b, client, 20) == 0
        assert net.heal("b") == ["b"]
        assert delivered(client, b, n) == n

        net.set_loss(5, "all")
        assert lab_tables(net.prefix) == [f"table bridge {net.prefix}"]
    finally:
        for s in socks:
            s.close()
        netns.destroy(tmp_path)
    assert lab_leftovers(net.prefix) == []  # the loss table too


def lab_tables(prefix: str) -> list[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.split()[-1:] == [prefix]]


def test_packet_loss_without_nft_names_what_is_missing(tmp_path, monkeypatch):
    """No nft on PATH: setting loss fails with one message naming nftables; link cuts still work."""
    net = netns.Network.plan(tmp_path, netns.DEFAULT_SUBNET, [("a", "z1")])
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(netns.NetnsError, match="nftables: the nft command is not installed"):
        net.set_loss(5, "all")
    assert netns.loss_supported() == "the nft command (nftables) is not installed"
