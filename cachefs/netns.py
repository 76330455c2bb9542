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
``tc netem loss 100%``), :meth:`Network.heal` puts it back. Latency: a zone's
links get a ``tc netem`` one-way delay on every packet delivered to its nodes.
netem needs the kernel's ``sch_netem``; without it those calls fail with a
clear error (``link`` cuts need nothing).

Clean-up: the state file ``netns.json`` (in the lab directory) is written
before anything is created, and :func:`destroy` removes every namespace and
link whose name starts with the lab's prefix, so ``lab down`` cleans up after
a crash of ``lab up`` itself, and never touches anything it did not create.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import logging
import os
import re
import secrets
import socket
import subprocess
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click

log = logging.getLogger(__name__)

STATE_FILE = "netns.json"
DEFAULT_SUBNET = "10.254.0.0/24"
CLIENT = "client"
CLIENT_ZONE = "z1"
NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_PREFIX = re.compile(r"^cfs[0-9a-f]{5}$")

T = TypeVar("T")


class NetnsError(click.ClickException):
    """An ``ip``/``tc`` step failed; the message names the command and its error."""


def node_ip(subnet: str, index: int) -> str:
    """Address of endpoint ``index``: 0 is the client (.2), daemons are .10, .11, ..."""
    try:
        net = ipaddress.ip_network(subnet)
    except ValueError as exc:
        raise click.UsageError(f"subnet {subnet!r}: {exc}") from None
    host = 2 if index == 0 else 9 + index
    if host >= net.num_addresses - 1:
        raise click.UsageError(f"subnet {subnet} is too small for {index} lab nodes")
    if not net.is_private:
        raise click.UsageError(f"subnet {subnet} is not a private range")
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
        """A node name, or a zone name meaning every daemon of that zone (never the client)."""
        zone = [ep for ep in self.endpoints if ep.zone == target and ep.name != CLIENT]
        if zone:
            return zone
        try:
            return [self.endpoint(target)]
        except KeyError:
            zones = sorted({ep.zone for ep in self.endpoints})
            raise click.UsageError(f"{target!r} is neither a lab node nor a zone ({', '.join(zones)})") from None

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
                if ep.name in self.cut_links:
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
        """Take a node or every daemon of a zone off the bridge; returns the names cut."""
        if how not in ("link", "loss"):
            raise click.UsageError(f"cut how={how!r}: use link or loss")
        eps = self.targets(target)
        for ep in eps:
            self.cut_links[ep.name] = how
            self.save()
            if how == "link":
                _ip("link", "set", ep.veth, "down")
            else:
                self._qdisc(ep, loss=True)
        log.info("cut %s (%s): %s", target, how, ", ".join(ep.name for ep in eps))
        return [ep.name for ep in eps]

    def heal(self, target: str | None = None) -> list[str]:
        """Undo :meth:`cut` for a node, a zone, or (None) everything cut."""
        eps = [ep for ep in self.endpoints if ep.name in self.cut_links] if target is None else self.targets(target)
        healed = []
        for ep in eps:
            how = self.cut_links.pop(ep.name, None)
            if how is None:
                continue
            if how == "link":
                _ip("link", "set", ep.veth, "up")
            else:
                self._qdisc(ep, loss=False)
            self.save()
            healed.append(ep.name)
        log.info("healed %s", ", ".join(healed) or "nothing")
        return healed

    def set_latency(self, zone: str, delay: str | None) -> None:
        """Delay every packet delivered to ``zone``'s nodes by ``delay`` (e.g. "20ms"); None removes it."""
        if not re.fullmatch(r"\d+(\.\d+)?(us|ms|s)", delay or "0ms"):
            raise click.UsageError(f"latency {delay!r}: use a duration like 500us, 20ms, 1s")
        if delay:
            self.latency[zone] = delay
        else:
            self.latency.pop(zone, None)
        self.save()
        for ep in self.endpoints:
            if ep.zone == zone and ep.name != CLIENT:
                self._qdisc(ep, loss=self.cut_links.get(ep.name) == "loss")

    def _qdisc(self, ep: Endpoint, *, loss: bool) -> None:
        delay = self.latency.get(ep.zone) if ep.name != CLIENT else None
        if not delay and not loss:
            _tc("qdisc", "del", "dev", ep.veth, "root", ok_errors=("No such file", "Cannot delete qdisc with handle of zero"))
            return
        netem = ["netem"] + (["delay", delay] if delay else []) + (["loss", "100%"] if loss else [])
        _tc("qdisc", "replace", "dev", ep.veth, "root", *netem)


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
        return str(exc.message)
    except FileNotFoundError:
        return "the ip command (iproute2) is not installed"
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
    net.state_path.unlink(missing_ok=True)
    log.info("removed %d network namespaces and links of lab %s", len(removed), net.prefix)
    return removed


# ---------------------------------------------------------------- ip, tc, setns

def _run(argv: list[str], ok_errors: tuple[str, ...] = ()) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        err = proc.stderr.strip()
        if any(e in err for e in ok_errors):
            return ""
        hint = ""
        if argv[0] == "tc" and "netem" in argv and "unknown" in err.lower():
            hint = " (this kernel has no sch_netem: latency and loss cuts are unavailable; link cuts work)"
        raise NetnsError(f"`{' '.join(argv)}` failed: {err}{hint}")
    return proc.stdout


def _ip(*args: str, ok_errors: tuple[str, ...] = ()) -> str:
    return _run(["ip", *args], ok_errors)


def _tc(*args: str, ok_errors: tuple[str, ...] = ()) -> str:
    return _run(["tc", *args], ok_errors)


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


__all__ = ["Network", "NetnsError", "destroy", "netns_supported", "node_ip"]


# ---------------------------------------------------------------- CLI (cachefs lab cut|heal|latency)

_dir_option = click.option("--dir", "root", default=None, type=click.Path(file_okay=False),
                           help="The lab's directory (default: /tmp/cachefs-lab).")


def _lab_network(root: str | None) -> Network:
    from cachefs.lab import DEFAULT_DIR

    net = Network.load(root or DEFAULT_DIR)
    if net is None:
        raise click.ClickException(f"no network namespaces in {root or DEFAULT_DIR}: "
                                   "start the lab with `cachefs lab up --netns`")
    return net


@click.command("cut")
@click.argument("target")
@click.option("--how", type=click.Choice(["link", "loss"]), default="link", show_default=True,
              help="link: the node's veth goes down; loss: netem drops every packet to it.")
@_dir_option
def cut_command(target: str, how: str, root: str | None) -> None:
    """Cut TARGET (a node like data3, or a zone like z2) off a --netns lab's network."""
    click.echo(f"cut off: {', '.join(_lab_network(root).cut(target, how))}")


@click.command("heal")
@click.argument("target", required=False)
@_dir_option
def heal_command(target: str | None, root: str | None) -> None:
    """Reconnect TARGET (a node or a zone; default: everything cut)."""
    healed = _lab_network(root).heal(target)
    click.echo(f"reconnected: {', '.join(healed) or 'nothing was cut'}")


@click.command("latency")
@click.argument("zone")
@click.argument("delay", required=False)
@_dir_option
def latency_command(zone: str, delay: str | None, root: str | None) -> None:
    """Add DELAY (like 20ms) to every packet bound for ZONE's nodes; no DELAY removes it (needs sch_netem)."""
    _lab_network(root).set_latency(zone, delay)
    click.echo(f"{zone}: {delay or 'no added'} latency")
