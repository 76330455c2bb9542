"""The lab on network namespaces: every daemon on its own address.

``cachefs lab up --netns`` runs the same 15 daemons as the plain lab, but each
in its own network namespace, joined by one bridge the way containers are
joined by a compose network. Nodes then talk over real, distinct addresses,
and a zone can be cut off or slowed down on the wire.

Layout (``P`` is a prefix unique to one lab, ``cfs`` + 5 random hex digits)::

    root namespace                       namespace P-<node> (one per daemon)
    +-----------+   P-h<i> <-- veth --> eth0  10.254.0.<10+i>/24
    |  P-br     |   (port of the bridge)
    |  (bridge, |   P-h0   <-- veth --> eth0  10.254.0.2/24   namespace P-client
    |   no IP)  |                        (the FUSE mount and the lab's own RPCs)
    +-----------+

The root namespace gets no address and no route: the lab's addresses (a
private range, 10.254.0.0/24 by default) exist only inside namespaces created
here, so nothing outside the lab can collide with them or reach them. The
mount runs in ``P-client`` (zone z1) through ``nsenter --net`` only, so its
FUSE mount lives in the ordinary mount namespace and everyone on the machine
sees it.

Faults: :meth:`Network.cut` takes a node or a whole zone off the bridge
(``ip link set P-h<i> down``: both directions, like pulling a cable; or
``--how loss``: 100% packet loss), :meth:`Network.heal` puts it back.

Packet loss (:meth:`Network.set_loss`) is an nftables table ``bridge P`` in
the root namespace, hooked on the bridge's *forward* path: for every lossy
endpoint, one rule drops each frame entering the bridge from its veth
(``iifname P-h<i>``) and one drops each frame the bridge sends to it
(``oifname P-h<i>``), each with ``numgen random`` probability. So both
directions of that link lose packets, ARP included, and like loss on a wire
it happens after the sender's stack let go of the packet: no socket ever sees
an error (a drop in the node's own output hook would return EPERM to the
sender instead). A packet between two lossy endpoints crosses two lossy links:
with 5% on all links, about 9.75% of packets between two nodes are lost. It
needs the kernel's nf_tables with the bridge family and numgen, and the
``nft`` command; netem is not needed (the kernels this was built on have none).

Latency: a zone's links get a ``tc netem`` one-way delay on every packet
delivered to its nodes. netem needs the kernel's ``sch_netem``; without it
that call fails with a clear error.

Clean-up: the state file ``netns.json`` (in the lab directory) is written
before anything is created, and :func:`destroy` removes every namespace and
link whose name starts with the lab's prefix, so ``lab down`` cleans up after
a crash of ``lab up`` itself, and never touches anything it did not create.

Errors: :class:`NetnsError` when a step fails, :class:`BadArgument` for
input that cannot be; the ``cachefs lab`` commands (:mod:`cachefs.lab.cli`)
show them as click errors.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

STATE_FILE = "netns.json"
DEFAULT_SUBNET = "10.254.0.0/24"
CLIENT = "client"
CLIENT_ZONE = "z1"
ALL = "all"  # target: every endpoint of the lab, the client too
NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_PREFIX = re.compile(r"^cfs[0-9a-f]{5}$")

T = TypeVar("T")


class NetnsError(Exception):
    """An ``ip``/``tc``/``nft`` step failed (the message names the command and its
    error), or a state file names interfaces that are not a lab's."""


class BadArgument(ValueError):
    """A subnet, target, delay, percentage or cut kind that cannot be: the caller's mistake."""


def node_ip(subnet: str, index: int) -> str:
    """Address of endpoint ``index``: 0 is the client (.2), daemons are .10, .11, ..."""
    try:
        net = ipaddress.ip_network(subnet)
    except ValueError as exc:
        raise BadArgument(f"subnet {subnet!r}: {exc}") from None
    host = 2 if index == 0 else 9 + index
    if host >= net.num_addresses - 1:
        raise BadArgument(f"subnet {subnet} is too small for {index} lab nodes")
    if not net.is_private:
        raise BadArgument(f"subnet {subnet} is not a private range")
    return str(net.network_address + host)


@dataclass
class Endpoint:
    name: str  # lab node name, or "client"
    ns: str
    veth: str  # host side, a port of the bridge
    ip: str
    zone: str


@dataclass
class Network:
    root: str
    prefix: str
    subnet: str
    endpoints: list[Endpoint]
    latency: dict[str, str] = field(default_factory=dict)  # zone -> netem delay
    cut_links: dict[str, str] = field(default_factory=dict)  # endpoint -> "link" | "loss"
    loss: dict[str, float] = field(default_factory=dict)  # endpoint -> percent of packets dropped each way

    # ------------------------------------------------------------ plan and state

    @classmethod
    def plan(cls, root: str | Path, subnet: str, nodes: Iterable[tuple[str, str]]) -> Network:
        """A network for ``nodes`` (name, zone) in lab order; creates nothing."""
        prefix = "cfs" + secrets.token_hex(3)[:5]
        eps = [Endpoint(CLIENT, f"{prefix}-{CLIENT}", f"{prefix}-h0", node_ip(subnet, 0), CLIENT_ZONE)]
        for i, (name, zone) in enumerate(nodes, 1):
            eps.append(Endpoint(name, f"{prefix}-{name}", f"{prefix}-h{i}", node_ip(subnet, i), zone))
        return cls(str(root), prefix, subnet, eps)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def state_path(self) -> Path:
        return Path(self.root) / STATE_FILE

    def save(self) -> None:
        Path(self.root).mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(self.state_path)

    @classmethod
    def load(cls, root: str | Path) -> Network | None:
        try:
            data = json.loads((Path(root) / STATE_FILE).read_text())
        except FileNotFoundError:
            return None
        data["endpoints"] = [Endpoint(**e) for e in data["endpoints"]]
        net = cls(**data)
        if not _PREFIX.match(net.prefix):
            raise NetnsError(f"{net.state_path}: {net.prefix!r} is not a lab prefix; not touching it")
        return net

    def endpoint(self, name: str) -> Endpoint:
        for ep in self.endpoints:
            if ep.name == name:
                return ep
        raise KeyError(f"no node {name!r} in this lab's network")

    def targets(self, target: str) -> list[Endpoint]:
        """A node name, a zone name meaning every daemon of that zone (never the client),
        or ``all``: every endpoint, the client too."""
        if target == ALL:
            return list(self.endpoints)
        zone = [ep for ep in self.endpoints if ep.zone == target and ep.name != CLIENT]
        if zone:
            return zone
        try:
            return [self.endpoint(target)]
        except KeyError:
            zones = sorted({ep.zone for ep in self.endpoints})
            raise BadArgument(f"{target!r} is neither a lab node nor a zone ({', '.join(zones)}; "
                                   f"{ALL!r}: every link)") from None

    # ------------------------------------------------------------ create

    def create(self) -> None:
        """Bridge, namespaces, veths and addresses; then check every address answers.

        The state file is written first: whatever exists of this network after
        a crash anywhere below, :func:`destroy` finds it by prefix.
        """
        self.save()
        plen = ipaddress.ip_network(self.subnet).prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for ep in self.endpoints:
            _ip("netns", "add", ep.ns)
            _ip("link", "add", ep.veth, "type", "veth", "peer", "name", "eth0", "netns", ep.ns)
            _ip("link", "set", ep.veth, "master", self.bridge, "up")
            _ip("-n", ep.ns, "link", "set", "lo", "up")
            _ip("-n", ep.ns, "addr", "add", f"{ep.ip}/{plen}", "dev", "eth0")
            _ip("-n", ep.ns, "link", "set", "eth0", "up")
        for zone, delay in list(self.latency.items()):
            self.set_latency(zone, delay)
        if self.loss:
            self._apply_loss()
        self.check()

    def exists(self) -> bool:
        return _link_exists(self.bridge) and all((NETNS_DIR / ep.ns).exists() for ep in self.endpoints)

    def check(self, timeout: float = 3.0) -> None:
        """From the client namespace, every daemon's address must answer (a refused
        connection counts: the packet got there). A host whose bridge traffic is
        filtered (br_netfilter with a DROP policy) fails here, not later."""
        def probe() -> list[str]:
            silent = []
            for ep in self.endpoints[1:]:
                if ep.name in self.cut_links or self.loss_of(ep.name) or self.loss_of(CLIENT):
                    continue
                with socket.socket() as s:
                    s.settimeout(timeout)
                    try:
                        s.connect((ep.ip, 9))
                    except ConnectionRefusedError:
                        continue
                    except OSError:
                        silent.append(f"{ep.name} ({ep.ip})")
            return silent

        silent = self.run_in(CLIENT, probe)
        if silent:
            raise NetnsError(f"lab bridge {self.bridge}: no answer from {', '.join(silent)} "
                             "(is bridged traffic filtered? see net.bridge.bridge-nf-call-iptables)")

    # ------------------------------------------------------------ use

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run in ``name``'s network namespace (and only that namespace)."""
        return ["nsenter", f"--net={NETNS_DIR / self.endpoint(name).ns}", "--", *argv]

    def run_in(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a new thread inside ``name``'s network namespace.

        setns(CLONE_NEWNET) switches only the calling thread, so the caller's
        own sockets stay where they were; threads started from ``fn`` inherit
        the namespace.
        """
        path = NETNS_DIR / self.endpoint(name).ns
        out: dict[str, Any] = {}

        def body() -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    _setns(fd)
                finally:
                    os.close(fd)
                out["value"] = fn(*args)
            except BaseException as exc:  # re-raised on the caller's thread
                out["error"] = exc

        thread = threading.Thread(target=body, name=f"netns-{name}")
        thread.start()
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    # ------------------------------------------------------------ faults

    def cut(self, target: str, how: str = "link") -> list[str]:
        """Take a node or every daemon of a zone off the bridge; returns the names cut.

        ``link``: the host side of its veth goes down. ``loss``: 100% packet
        loss both ways (nftables, see :meth:`set_loss`).
        """
        if how not in ("link", "loss"):
            raise BadArgument(f"cut how={how!r}: use link or loss")
        eps = self.targets(target)
        for ep in eps:
            self.cut_links[ep.name] = how
        self.save()  # first: a crash below leaves state that destroy() and heal() act on
        if how == "link":
            for ep in eps:
                _ip("link", "set", ep.veth, "down")
        else:
            self._apply_loss()
        log.info("cut %s (%s): %s", target, how, ", ".join(ep.name for ep in eps))
        return [ep.name for ep in eps]

    def heal(self, target: str | None = None) -> list[str]:
        """Undo :meth:`cut` and :meth:`set_loss` for a node, a zone, ``all`` or (None) everything."""
        eps = ([ep for ep in self.endpoints if ep.name in self.cut_links or ep.name in self.loss]
               if target is None else self.targets(target))
        healed = []
        had_loss = self._loss_rules() != []
        for ep in eps:
            how = self.cut_links.pop(ep.name, None)
            lossy = self.loss.pop(ep.name, None)
            if how == "link":
                _ip("link", "set", ep.veth, "up")
                _wait_forwarding(ep.veth)
            if how or lossy:
                healed.append(ep.name)
        self.save()
        if had_loss:
            self._apply_loss()
        log.info("healed %s", ", ".join(healed) or "nothing")
        return healed

    def loss_of(self, name: str) -> float:
        """Percent of packets dropped each way on ``name``'s link (100 when cut with ``loss``)."""
        return 100.0 if self.cut_links.get(name) == "loss" else self.loss.get(name, 0.0)

    def set_loss(self, percent: float, target: str = "all") -> list[str]:
        """Drop ``percent`` % of the packets each way on the links of ``target`` (a node,
        a zone or ``all``); 0 removes it. Returns the names it applies to."""
        if not 0 <= percent <= 100:
            raise BadArgument(f"loss {percent}%: use a percentage from 0 to 100")
        eps = self.targets(target)
        for ep in eps:
            if percent:
                self.loss[ep.name] = float(percent)
            else:
                self.loss.pop(ep.name, None)
        self.save()
        self._apply_loss()
        log.info("%s%% packet loss on %s", percent, ", ".join(ep.name for ep in eps))
        return [ep.name for ep in eps]

    def dropped(self) -> dict[str, int]:
        """Packets dropped so far on each lossy endpoint's link, both ways together
        (counted since the loss rules last changed; {} when there are none)."""
        if not shutil.which("nft"):
            return {}
        out = _run(["nft", "-j", "list", "table", "bridge", self.prefix], ok_errors=("No such file",))
        if not out:
            return {}
        by_veth = {ep.veth: ep.name for ep in self.endpoints}
        counts: dict[str, int] = {}
        for item in json.loads(out)["nftables"]:
            expr = item.get("rule", {}).get("expr", [])
            veth = next((e["match"]["right"] for e in expr if "match" in e
                         and e["match"]["left"].get("meta", {}).get("key") in ("iifname", "oifname")), None)
            packets = sum(e["counter"]["packets"] for e in expr if "counter" in e)
            if veth in by_veth:
                counts[by_veth[veth]] = counts.get(by_veth[veth], 0) + packets
        return counts

    def _loss_rules(self) -> list[str]:
        rules = []
        for ep in self.endpoints:
            if pct := self.loss_of(ep.name):
                threshold = round(pct * 100)  # numgen draws 0..9999: a resolution of 0.01%
                draw = f"numgen random mod 10000 < {threshold} " if threshold < 10000 else ""
                for way in ("iifname", "oifname"):
                    rules.append(f'{way} "{ep.veth}" {draw}counter drop')
        return rules

    def _apply_loss(self) -> None:
        """Replace the lab's loss table with one made from the state (one atomic nft transaction);
        no lossy endpoint: no table."""
        table = f"bridge {self.prefix}"
        script = f"table {table} {{}}\ndelete table {table}\n"
        if rules := self._loss_rules():
            body = "\n".join(f"    {r}" for r in rules)
            script += (f"table {table} {{\n  chain loss {{\n"
                       f"    type filter hook forward priority filter; policy accept;\n{body}\n  }}\n}}\n")
        _nft(script)

    def set_latency(self, zone: str, delay: str | None) -> None:
        """Delay every packet delivered to ``zone``'s nodes by ``delay`` (e.g. "20ms"); None removes it."""
        if not re.fullmatch(r"\d+(\.\d+)?(us|ms|s)", delay or "0ms"):
            raise BadArgument(f"latency {delay!r}: use a duration like 500us, 20ms, 1s")
        if delay:
            self.latency[zone] = delay
        else:
            self.latency.pop(zone, None)
        self.save()
        for ep in self.endpoints:
            if ep.zone == zone and ep.name != CLIENT:
                self._qdisc(ep)

    def _qdisc(self, ep: Endpoint) -> None:
        delay = self.latency.get(ep.zone) if ep.name != CLIENT else None
        if not delay:
            _tc("qdisc", "del", "dev", ep.veth, "root", ok_errors=("No such file", "Cannot delete qdisc with handle of zero"))
            return
        _tc("qdisc", "replace", "dev", ep.veth, "root", "netem", "delay", delay)


def ensure(root: str | Path, subnet: str, nodes: list[tuple[str, str]]) -> Network:
    """The lab's network: the existing one if complete and of this plan, else a new one.

    A partial network (``lab up`` crashed while building it) is removed first;
    a failure while building removes what was built.
    """
    net = Network.load(root)
    if (net is not None and net.subnet == subnet and net.exists()
            and [(ep.name, ep.zone) for ep in net.endpoints[1:]] == nodes):
        return net
    destroy(root)
    net = Network.plan(root, subnet, nodes)
    try:
        net.create()
    except BaseException:
        destroy(root)
        raise
    log.info("lab network %s: bridge %s, %d namespaces in %s", net.prefix, net.bridge,
             len(net.endpoints), subnet)
    return net


def netns_supported() -> str | None:
    """None when this process may create network namespaces, else the reason it may not."""
    probe = f"cfs{secrets.token_hex(3)[:5]}-probe"
    try:
        _ip("netns", "add", probe)
    except NetnsError as exc:
        return str(exc)
    except FileNotFoundError:
        return "the ip command (iproute2) is not installed"
    _ip("netns", "del", probe)
    return None


def loss_supported() -> str | None:
    """None when packet loss can work here (nft, and a kernel that takes a bridge table with
    a numgen rule; tried in a throwaway namespace), else the reason it cannot."""
    if shutil.which("nft") is None:
        return "the nft command (nftables) is not installed"
    probe = f"cfs{secrets.token_hex(3)[:5]}-probe"
    try:
        _ip("netns", "add", probe)
    except (NetnsError, FileNotFoundError) as exc:
        return f"cannot make a network namespace to try nft in: {exc}"
    try:
        _run(["ip", "netns", "exec", probe, "nft", "-f", "-"],
             stdin="table bridge t {\n  chain c {\n    type filter hook forward priority filter;\n"
                   "    numgen random mod 10000 < 500 counter drop\n  }\n}\n")
    except NetnsError as exc:
        return str(exc)
    finally:
        _ip("netns", "del", probe)
    return None


def destroy(root: str | Path) -> list[str]:
    """Remove every namespace and link of the lab in ``root`` (by its prefix), then the state file.

    Works from the state file alone: nothing else needs to have survived.
    Returns what was removed.
    """
    net = Network.load(root)
    if net is None:
        return []
    removed = []
    mine = f"{net.prefix}-"
    for name in _list_netns():
        if name.startswith(mine):
            _ip("netns", "del", name, ok_errors=("No such file",))
            removed.append(name)
    for name in _list_links():  # veth host sides vanish with their namespace; the bridge does not
        if name.startswith(mine):
            _ip("link", "del", name, ok_errors=("Cannot find device",))
            removed.append(name)
    if net.prefix in _list_nft_tables():  # the loss rules live in the root namespace
        _run(["nft", "delete", "table", "bridge", net.prefix], ok_errors=("No such file",))
        removed.append(f"nft table bridge {net.prefix}")
    net.state_path.unlink(missing_ok=True)
    log.info("removed %d network namespaces and links of lab %s", len(removed), net.prefix)
    return removed


# ---------------------------------------------------------------- ip, tc, setns

def _run(argv: list[str], ok_errors: tuple[str, ...] = (), stdin: str | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, input=stdin)
    if proc.returncode != 0:
        err = proc.stderr.strip()
        if any(e in err for e in ok_errors):
            return ""
        hint = ""
        if argv[0] == "tc" and "netem" in argv and "unknown" in err.lower():
            hint = (" (this kernel has no sch_netem: latency is unavailable; link cuts and packet loss, "
                    "which use nftables, work)")
        if "nft" in argv[:4] and ("No such file" in err or "not supported" in err):
            hint = (" (packet loss needs the kernel's nf_tables with the bridge family and numgen: "
                    "CONFIG_NF_TABLES_BRIDGE, CONFIG_NFT_NUMGEN)")
        raise NetnsError(f"`{' '.join(argv)}` failed: {err}{hint}")
    return proc.stdout


def _wait_forwarding(veth: str, timeout: float = 5.0) -> None:
    """Wait until a veth set up again carries traffic: carrier up and its bridge port forwarding.

    `ip link set up` returns before either; a probe sent in between is lost, and
    the next ARP or SYN retry is a second away, so a heal looked like no heal.
    """
    sysfs = Path("/sys/class/net") / veth
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            up = (sysfs / "operstate").read_text().strip() == "up"
            port = sysfs / "brport" / "state"
            forwarding = not port.exists() or port.read_text().strip() == "3"
        except OSError:
            up = forwarding = False
        if up and forwarding:
            return
        time.sleep(0.02)
    log.warning("%s not forwarding %.0f s after heal", veth, timeout)


def _ip(*args: str, ok_errors: tuple[str, ...] = ()) -> str:
    return _run(["ip", *args], ok_errors)


def _tc(*args: str, ok_errors: tuple[str, ...] = ()) -> str:
    return _run(["tc", *args], ok_errors)


def _nft(script: str) -> str:
    if shutil.which("nft") is None:
        raise NetnsError("packet loss needs nftables: the nft command is not installed "
                         "(apt-get install nftables; make deps installs it)")
    return _run(["nft", "-f", "-"], stdin=script)


def _list_nft_tables() -> list[str]:
    """Names of the root namespace's nftables tables of family bridge ([] without nft)."""
    if shutil.which("nft") is None:
        return []
    return [line.split()[-1] for line in _run(["nft", "list", "tables", "bridge"]).splitlines() if line.strip()]


def _list_netns() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _list_links() -> list[str]:
    return [entry["ifname"] for entry in json.loads(_ip("-j", "link", "show") or "[]")]


def _link_exists(name: str) -> bool:
    return name in _list_links()


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")
