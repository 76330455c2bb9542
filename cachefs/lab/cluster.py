"""The local lab: a whole cachefs cluster on one machine.

``cachefs lab up`` starts 3 metanodes, 6 datanodes and 6 cache nodes spread
over 3 zones (real processes on 127.0.0.1, each with its own data directory
and log file), creates an ``ec:4+2`` volume and mounts it. ``lab status``
shows every process, the metanode leader and the cache tier's usage and hit
rates; ``lab down`` unmounts and stops everything, also after ``lab up``
itself crashed, since every PID is recorded in a state file first. With
``--netns`` every daemon runs in its own network namespace on its own
address (:mod:`cachefs.lab.netns`), so zones can be cut off, made lossy and healed. With
``--tls`` the lab makes a throwaway CA and one certificate per node (and one
for clients) under ``DIR/tls`` (:mod:`cachefs.lab.pki`), and every link,
daemon to daemon and client to daemon, runs mutual TLS.

The same :class:`Lab` class is what the end-to-end tests and benchmarks use
to start, kill and restart nodes, so the lab people run is the lab we test.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio

from cachefs import queries as Q
from cachefs.commands import CreateVolume
from cachefs.config import load_tls
from cachefs.credentials import Credential
from cachefs.errors import CacheFSError
from cachefs.lab import netns, prometheus, s3demo
from cachefs.lab.pki import make_pki
from cachefs.lab.s3demo import DEMO_BUCKET, DEMO_PREFIX, S3_VOLUME, S3_VOLUME_BACKING
from cachefs.metanode.client import MetaClient
from cachefs.rpc import RpcPool
from cachefs.testing import s3server

log = logging.getLogger(__name__)

STATE_FILE = "lab.json"
VOLUME = "lab"
TLS_DIR = "tls"
UMOUNT_TIMEOUT = 120.0  # cachefs umount's own default: the mount commits for up to 60 s
TLS_CLIENT = "client"  # the certificate the mount, `lab status` and lab clients show


class LabError(Exception):
    """The lab cannot do what was asked (no lab there, a port taken, a node died
    starting, a mount failed); the message says what and where to look."""


@dataclass
class Node:
    name: str
    kind: str  # metanode | datanode | cachenode
    addr: str
    zone: str = ""
    pid: int | None = None
    metrics_port: int = 0
    join: bool = False  # a metanode that joins the running cluster (``cachefs metanode add``)

    @property
    def port(self) -> int:
        return int(self.addr.rsplit(":", 1)[1])


@dataclass
class LabConfig:
    root: str
    metanodes: int = 3
    datanodes: int = 6
    cachenodes: int = 6
    zones: int = 3
    base_port: int = 17000
    policy: str = "ec:4+2"
    compression: str = "none"
    data_capacity: str = "20G"
    cache_capacity: str = "2G"
    cache_memory: str = "64M"
    mount_cache: str = "4G"  # the mount's L2 (client-local flash cache)
    metrics: bool = True
    nodes: list[Node] = field(default_factory=list)
    mountpoint: str | None = None
    mount_pid: int | None = None
    mount_metrics_port: int = 0  # the mount's /metrics (0: metrics off)
    prometheus: bool = False  # a real Prometheus scraping every node (cachefs/lab/prometheus.py)
    prometheus_port: int = 0
    prometheus_pid: int | None = None
    netns: str = ""  # subnet of the lab's network namespaces (cachefs/netns.py); "": all on 127.0.0.1
    tls: bool = False  # mutual TLS on every link, certificates under ROOT/tls
    s3: bool = False  # a SeaweedFS S3 server (ROOT/s3): a demo bucket linked at /demo, volume lab-s3 in it
    s3_endpoint: str = ""
    s3_pid: int | None = None
    s3_ports: list[int] = field(default_factory=list)  # every port its weed listens on (its sockets, at down)
    # Further `cachefs metanode` options of every replica (tests: a shorter --lease-term or --node-timeout).
    metanode_options: list[str] = field(default_factory=list)
    cachenode_options: list[str] = field(default_factory=list)  # likewise for `cachefs cachenode`


class Lab:
    """A cluster of real processes under one directory."""

    def __init__(self, config: LabConfig) -> None:
        self.config = config
        self.root = Path(config.root)
        self._net: netns.Network | None = None
        # Popen objects of the nodes this Lab started: dropping one while its
        # process runs is a ResourceWarning (an error under pytest).
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        if not config.nodes:
            config.nodes = self._plan()

    # ------------------------------------------------------------ layout

    def _plan(self) -> list[Node]:
        c = self.config
        nodes = []
        for i in range(1, c.metanodes + 1):
            nodes.append(Node(f"meta{i}", "metanode", f"127.0.0.1:{c.base_port + i}",
                              zone=f"z{(i - 1) % c.zones + 1}"))
        for i in range(1, c.datanodes + 1):
            nodes.append(Node(f"data{i}", "datanode", f"127.0.0.1:{c.base_port + 100 + i}",
                              zone=f"z{(i - 1) % c.zones + 1}"))
        for i in range(1, c.cachenodes + 1):
            nodes.append(Node(f"cache{i}", "cachenode", f"127.0.0.1:{c.base_port + 200 + i}",
                              zone=f"z{(i - 1) % c.zones + 1}"))
        if c.metrics:
            for node in nodes:
                node.metrics_port = node.port + 1000
            c.mount_metrics_port = c.base_port + 1300
        if c.prometheus:
            c.prometheus_port = c.base_port + 1400
        if c.netns:  # same ports, each node on its own address in its own namespace
            for i, node in enumerate(nodes, 1):
                node.addr = f"{netns.node_ip(c.netns, i)}:{node.port}"
        return nodes

    @property
    def nodes(self) -> list[Node]:
        return self.config.nodes

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in this lab")

    def running(self) -> list[str]:
        """Names of the nodes whose recorded process is alive."""
        return [n.name for n in self.nodes if n.pid and _alive(n.pid)]

    def of_kind(self, kind: str) -> list[Node]:
        return [n for n in self.nodes if n.kind == kind]

    @property
    def meta_addrs(self) -> list[str]:
        return [n.addr for n in self.of_kind("metanode")]

    @property
    def secret_file(self) -> Path:
        return self.root / "secret"

    @property
    def secret(self) -> bytes:
        return self.secret_file.read_bytes().strip()

    def credential_file(self, role: str) -> Path:
        """``ROOT/admin.cred`` or ``ROOT/client.cred`` (a client of the lab's
        volume): the least credentials of the lab's admin commands and clients."""
        return self.root / f"{role}.cred"

    def credential(self, role: str) -> Credential:
        """The lab's ``admin`` credential (its own readiness, volume and status
        calls) or ``client`` credential (its mounts)."""
        self._issue_credentials()  # a lab started before credentials existed
        return Credential.from_json(self.credential_file(role).read_text(), str(self.credential_file(role)))

    def _issue_credentials(self) -> None:
        for role, volumes in (("admin", ()), ("client", (VOLUME, S3_VOLUME))):
            path = self.credential_file(role)
            if not path.exists():
                cred = Credential.issue(self.secret, role, f"lab-{role}", volumes)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(cred.to_json())

    # ------------------------------------------------------------ TLS

    @property
    def tls_dir(self) -> Path:
        return self.root / TLS_DIR

    def tls_files(self, name: str = TLS_CLIENT) -> dict[str, str]:
        """``{tls_cert, tls_key, tls_ca}`` of ``name`` (a node, or the client
        certificate), ready for ``connect(**...)``; empty without TLS."""
        if not self.config.tls:
            return {}
        d = self.tls_dir
        return {"tls_cert": str(d / f"{name}.pem"), "tls_key": str(d / f"{name}-key.pem"),
                "tls_ca": str(d / "ca.pem")}

    def tls_args(self, name: str = TLS_CLIENT) -> list[str]:
        """The same files as ``--tls-cert/--tls-key/--tls-ca`` options."""
        return [arg for key, path in self.tls_files(name).items()
                for arg in (f"--{key.replace('_', '-')}", path)]

    def client_tls(self) -> ssl.SSLContext | None:
        """The client context of the lab's own calls (readiness, status)."""
        files = self.tls_files()
        return load_tls(files["tls_cert"], files["tls_key"], files["tls_ca"])[1] if files else None

    def _make_certificates(self) -> None:
        """The CA and every missing certificate (each node's carries its own address)."""
        hosts = {n.name: n.addr.rsplit(":", 1)[0] for n in self.nodes}
        hosts[TLS_CLIENT] = "127.0.0.1"
        make_pki(self.tls_dir, hosts)

    def _argv(self, node: Node) -> list[str]:
        base = [sys.executable, "-m", "cachefs.cli"]
        metrics = ["--metrics-addr", str(node.metrics_port)] if node.metrics_port else ["--no-metrics"]
        common = ["--secret-file", str(self.secret_file), *metrics, *self.tls_args(node.name),
                  "--log-file", str(self.log_path(node.name))]
        meta = ",".join(self.meta_addrs)
        d = str(self.root / node.name)
        if node.kind == "metanode":
            index = node.name.removeprefix("meta")
            peers = ",".join(f"{m.name.removeprefix('meta')}={m.addr}" for m in self.of_kind("metanode"))
            return [*base, "metanode", "--id", index, "--peers", peers, "--data-dir", d,
                    "--listen", node.addr, *(["--join"] if node.join else []), *self.config.metanode_options,
                    *common]
        if node.kind == "datanode":
            return [*base, "datanode", "--zone", node.zone, "--data-dir", d, "--capacity",
                    self.config.data_capacity, "--listen", node.addr, "--meta", meta,
                    "--node-id", node.name, "--heartbeat", "1", *common]
        return [*base, "cachenode", "--zone", node.zone, "--cache-dir", d, "--capacity",
                self.config.cache_capacity, "--memory", self.config.cache_memory, "--listen",
                node.addr, "--meta", meta, "--node-id", node.name, "--heartbeat", "1",
                *self.config.cachenode_options, *common]

    # ------------------------------------------------------------ processes

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self.config), indent=2))
        tmp.replace(self.root / STATE_FILE)

    @classmethod
    def load(cls, root: str | Path) -> Lab:
        path = Path(root) / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise LabError(f"no lab in {root} (no {STATE_FILE}); start one with `cachefs lab up`") from None
        data["nodes"] = [Node(**n) for n in data["nodes"]]
        return cls(LabConfig(**data))

    def log_path(self, name: str) -> Path:
        """logs/NAME.log: a node's ``--log-file`` (reopened on SIGHUP, so logrotate works)."""
        return self.root / "logs" / f"{name}.log"

    def start(self, name: str) -> None:
        """Start (or restart) one node; its output goes to logs/NAME.log (before
        its logging is set up, through the file it inherits)."""
        node = self.node(name)
        if node.pid and _alive(node.pid):
            raise LabError(f"{name} is already running (pid {node.pid})")
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        (self.root / node.name).mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path(name), "ab")  # noqa: SIM115 - handed to the child
        argv = self.network.wrap(name, self._argv(node)) if self.config.netns else self._argv(node)
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=self._env(node.kind),
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.root)
        logf.close()
        self._procs[name] = proc
        node.pid = proc.pid
        self.save()

    def _env(self, kind: str) -> dict[str, str] | None:
        """A node's or mount's environment: with --s3, the store's identity for
        its kind (``s3demo.IDENTITIES``) in the standard AWS variables."""
        if not self.config.s3 or kind not in s3demo.IDENTITIES:
            return None
        return {**os.environ, **s3server.credentials_env(kind)}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one node (SIGKILL by default: the fault tests' kill -9)."""
        node = self.node(name)
        if node.pid and _alive(node.pid):
            _signal(node.pid, sig)
            _reap(node.pid, timeout=10)
        self._forget(name)
        node.pid = None
        self.save()

    def _start_prometheus(self) -> None:
        if self.config.netns:
            raise LabError("--prometheus scrapes 127.0.0.1: it does not reach namespaced nodes (--netns)")
        try:
            proc = prometheus.start(self)
        except prometheus.PrometheusUnavailable as exc:
            raise LabError(str(exc)) from None
        self._procs["prometheus"] = proc
        self.config.prometheus_pid = proc.pid
        self.save()

    def _forget(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is not None:
            proc.poll()  # records the exit (or ECHILD: _alive reaped it already)

    def up(self, *, timeout: float = 60.0) -> None:
        """Start every node, wait until the cluster is ready, create the volume."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.secret_file.exists():
            self.secret_file.write_text(secrets.token_hex(32) + "\n")
            self.secret_file.chmod(0o600)
        self._issue_credentials()
        if self.config.tls:
            self._make_certificates()
        self.save()
        if self.config.netns:
            self._net = netns.ensure(self.root, self.config.netns, [(n.name, n.zone) for n in self.nodes])
        stopped = [n for n in self.nodes if not (n.pid and _alive(n.pid))]
        if not self.config.netns:  # namespaced nodes each have an address of their own
            _check_ports_free(stopped)
        s3_new = self.config.s3 and not (self.config.s3_pid and _alive(self.config.s3_pid))
        if s3_new:
            self._start_s3()
        for node in stopped:
            self.start(node.name)
        self.run(self._wait_ready, timeout)
        if self.config.prometheus and not (self.config.prometheus_pid and _alive(self.config.prometheus_pid)):
            self._start_prometheus()
        if s3_new:
            self.run(self._s3_demo)

    def _start_s3(self) -> None:
        if self.config.netns:
            raise LabError("--s3 serves on 127.0.0.1: it does not reach namespaced nodes (--netns)")
        server = s3server.SeaweedS3(self.root / "s3", identities=s3demo.IDENTITIES)
        try:
            server.start()
        except RuntimeError as exc:
            raise LabError(f"the lab's S3 server did not start: {exc}") from None
        assert server.proc is not None
        self._procs["s3"] = server.proc
        self.config.s3_pid, self.config.s3_endpoint = server.proc.pid, server.endpoint
        self.config.s3_ports = list(server.ports.values())
        self.save()

    async def _s3_demo(self) -> None:
        """A small bucket of JPEG-sized objects in class folders, linked at /demo of the lab volume,
        and the volume ``lab-s3`` whose blocks are objects in the store (``volume create --backing``)."""
        import boto3

        from cachefs import commands as C
        from cachefs.cli.repo import resolve
        from cachefs.repo.importer import import_listing
        from cachefs.repo.s3 import S3Store

        env = s3server.credentials_env()
        s3 = boto3.client("s3", endpoint_url=self.config.s3_endpoint, region_name=env["AWS_DEFAULT_REGION"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])  # fmt: skip

        await trio.to_thread.run_sync(s3demo.fill, s3)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # boto3 reads the credentials from the environment
        try:
            store = S3Store(DEMO_BUCKET, name=f"the lab's demo link (s3://{DEMO_BUCKET}/{DEMO_PREFIX})",
                            endpoint=self.config.s3_endpoint, region=env["AWS_DEFAULT_REGION"])  # fmt: skip
            async with RpcPool(secret=self.credential("admin"), tls=self.client_tls()) as pool:
                mc = self.meta_client(pool)
                if S3_VOLUME not in (await mc.query(Q.ClusterMap()))["volumes"]:  # open, as the lab volume
                    await mc.mutate(CreateVolume(S3_VOLUME, "replica:1", backing=S3_VOLUME_BACKING,
                                                 backing_endpoint=self.config.s3_endpoint,
                                                 backing_region=env["AWS_DEFAULT_REGION"]))  # fmt: skip
                ino = await resolve(mc, VOLUME, "/demo", create=True)
                link = await mc.mutate(C.LinkRepo(VOLUME, ino, DEMO_BUCKET, DEMO_PREFIX, self.config.s3_endpoint,
                                                  env["AWS_DEFAULT_REGION"]))  # fmt: skip
                await import_listing(mc.mutate, link, store, {"": ""})
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    @property
    def network(self) -> netns.Network:
        """The lab's network namespaces (``--netns`` labs only)."""
        if self._net is None:
            self._net = netns.Network.load(self.root)
            if self._net is None:
                raise LabError(f"lab {self.root} has no network namespaces ({netns.STATE_FILE})")
        return self._net

    def run(self, async_fn: Any, *args: Any) -> Any:
        """``trio.run`` from where the lab's addresses are reachable (the client namespace with --netns)."""
        if self.config.netns:
            return self.network.run_in(netns.CLIENT, trio.run, async_fn, *args)
        return trio.run(async_fn, *args)

    def meta_client(self, pool: RpcPool, **kwargs: Any) -> MetaClient:
        return MetaClient(pool, self.meta_addrs, **kwargs)

    async def _wait_ready(self, timeout: float) -> None:
        async with RpcPool(secret=self.credential("admin"), tls=self.client_tls()) as pool:
            meta = self.meta_client(pool, deadline=2.0)
            with trio.fail_after(timeout):
                want_d, want_c = len(self.of_kind("datanode")), len(self.of_kind("cachenode"))
                while True:
                    self._check_alive()
                    try:
                        cmap = await meta.query(Q.ClusterMap())
                    except CacheFSError:
                        continue  # no leader yet
                    up_d = sum(1 for n in cmap["datanodes"] if n["state"] == "up")
                    up_c = sum(1 for n in cmap["cachenodes"] if n["state"] == "up")
                    if up_d >= want_d and up_c >= want_c:
                        break
                    await trio.sleep(0.2)
                log.info("metanode leader: %s", meta.leader)
                if VOLUME not in cmap["volumes"]:
                    # An open volume (no mount token): the lab's client credential
                    # (and any test's or benchmark's) mounts it without one.
                    await meta.mutate(CreateVolume(VOLUME, self.config.policy, self.config.compression))

    def _check_alive(self) -> None:
        dead = [n.name for n in self.nodes if n.pid and not _alive(n.pid)]
        if dead:
            logs = self.root / "logs"
            last = _last_line(logs / f"{dead[0]}.log")
            raise LabError(f"lab nodes exited during start-up: {', '.join(dead)} "
                           f"({dead[0]}: {last}; see {logs})")

    # ------------------------------------------------------------ mount

    def mount(self, mountpoint: str, *extra: str, l2: bool = True, name: str = "mount",
              volume: str = VOLUME) -> None:  # fmt: skip
        """Mount the lab volume (or ``volume``) in zone z1 with an L2 of ``mount_cache`` bytes
        under the lab's root, unless ``l2`` is false (tests of the cache
        tier itself, whose reads must reach it) or ``extra`` names one.

        ``name`` other than "mount" starts another mount of the same volume
        (two writers on one file): its own log ``logs/NAME.log`` and spill
        directory, no metrics, and not recorded as the lab's mount (its
        caller unmounts it)."""
        Path(mountpoint).mkdir(parents=True, exist_ok=True)
        main = name == "mount"
        if l2 and "--cache-dir" not in extra:
            extra = ("--cache-dir", str(self.root / f"{name}-l2"), "--cache-size", self.config.mount_cache, *extra)
        logf = self.log_path(name)
        argv = [sys.executable, "-m", "cachefs.cli", "mount", ",".join(self.meta_addrs), volume, mountpoint,
                "--background", "--zone", "z1", "--allow-other", "--secret-file", str(self.credential_file("client")),
                "--log-file", str(logf), "--spill-dir", str(self.root / ("spill" if main else f"{name}-spill")),
                *self.tls_args(), *(self._mount_metrics() if main else ["--no-metrics"]), *extra]
        if self.config.netns:
            argv = self.network.wrap(netns.CLIENT, argv)
        with open(logf, "ab") as out:
            result = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=60, env=self._env("mount"))
        if result.returncode != 0:
            tail = logf.read_text(errors="replace").splitlines()[-10:]
            raise LabError(f"mount failed (exit {result.returncode}):\n" + "\n".join(tail))
        if main:
            self.config.mountpoint = mountpoint
            self.save()

    def _mount_metrics(self) -> list[str]:
        port = self.config.mount_metrics_port
        return ["--metrics-addr", str(port)] if port else ["--no-metrics"]

    def umount(self, timeout: float = UMOUNT_TIMEOUT) -> None:
        """Unmount the lab's mount, giving its daemon ``timeout`` seconds to
        commit (what it cannot commit it spills, see client/spill.py). A
        daemon that does not finish is detached lazily; :meth:`down` then
        stops it with the lab's other daemons (it is one of their strays)."""
        mp = self.config.mountpoint
        if mp and _mounted(mp):
            argv = [sys.executable, "-m", "cachefs.cli", "umount", "--timeout", str(timeout), mp]
            try:
                subprocess.run(argv, timeout=timeout + 10, check=False)
            except subprocess.TimeoutExpired:
                pass
            if _mounted(mp):
                subprocess.run(["fusermount3", "-u", "-z", mp], check=False)
        self.config.mountpoint = None
        self.save()

    # ------------------------------------------------------------ teardown

    def down(self, *, wipe: bool = False, umount_timeout: float = UMOUNT_TIMEOUT) -> None:
        """Unmount, then stop every daemon of the lab, the mount's too, even
        when the unmount failed."""
        self.umount(umount_timeout)
        alive = [n.pid for n in self.nodes if n.pid and _alive(n.pid)] + self._strays()
        if self.config.prometheus_pid and _alive(self.config.prometheus_pid):
            alive.append(self.config.prometheus_pid)
        if self.config.s3_pid and _alive(self.config.s3_pid):
            alive.append(self.config.s3_pid)
        for pid in alive:
            _signal(pid, signal.SIGTERM)
        for pid in alive:
            if not _reap(pid, timeout=10):
                _signal(pid, signal.SIGKILL)
                _reap(pid, timeout=5)
        for node in self.nodes:
            self._forget(node.name)
            node.pid = None
        self._forget("prometheus")
        self.config.prometheus_pid = None
        self._forget("s3")
        self.config.s3_pid = None
        s3server.remove_sockets(self.config.s3_ports)
        self.save()
        if self.config.netns:
            netns.destroy(self.root)
            self._net = None
        if wipe:
            shutil.rmtree(self.root, ignore_errors=True)

    def _strays(self) -> list[int]:
        """Daemons of this lab the state file does not know: a ``lab up``
        killed between starting a node and recording its pid leaves one.
        They are found by their data directory under the lab's root."""
        marker = f"{self.root}/".encode()
        known = {n.pid for n in self.nodes if n.pid}
        strays = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in known:
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"cachefs.cli" in argv and any(arg.startswith(marker) for arg in argv) and _alive(int(entry.name)):
                strays.append(int(entry.name))
        return strays

    # ------------------------------------------------------------ status

    def _link_state(self, name: str) -> str:
        """A --netns node's link: "up", "cut" (link down), or "loss N%" (lab loss, or cut --how loss)."""
        net = self.network
        if net.cut_links.get(name) == "link":
            return "cut"
        return f"loss {net.loss_of(name):g}%" if net.loss_of(name) else "up"

    async def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nodes": [], "leader": None, "cache": [], "volumes": {}}
        async with RpcPool(secret=self.credential("admin"), tls=self.client_tls()) as pool:
            for node in self.nodes:
                alive = bool(node.pid and _alive(node.pid))
                health = None
                if alive:
                    try:
                        health = (await pool.call(node.addr, "health", timeout=2)).result
                    except CacheFSError as exc:
                        health = {"error": exc.code}
                out["nodes"].append({**asdict(node), "alive": alive, "health": health,
                                     **({"link": self._link_state(node.name)} if self.config.netns else {})})
            meta = self.meta_client(pool, deadline=3.0)
            try:
                cmap = await meta.query(Q.ClusterMap())
                out["leader"] = meta.leader
                out["volumes"] = {name: v.get("backing") or v["policy"] for name, v in cmap["volumes"].items()}
            except CacheFSError:
                pass
            for node in self.of_kind("cachenode"):
                if node.pid and _alive(node.pid):
                    try:
                        out["cache"].append({"name": node.name, **(await pool.call(node.addr, "stats", timeout=2)).result})
                    except CacheFSError as exc:
                        out["cache"].append({"name": node.name, "error": exc.code})
        return out


def _check_ports_free(nodes: list[Node]) -> None:
    """Refuse to start when another program holds a port a node needs, naming
    both, rather than letting that daemon die of EADDRINUSE mid start-up."""
    for node in nodes:
        host = node.addr.rsplit(":", 1)[0]
        for port in (node.port, node.metrics_port):
            if not port:
                continue
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                except OSError as exc:
                    raise LabError(
                        f"{host}:{port} ({node.name}) is in use by another program ({exc.strerror}): "
                        "stop it or start the lab with another --base-port") from None


def _last_line(path: Path) -> str:
    """The last line of a log with words on it (not a traceback's frame of
    ``+---`` and ``|``): usually the error a dead daemon died of."""
    try:
        tail = path.read_bytes()[-4096:].decode(errors="replace")
    except OSError:
        return "no log"
    lines = [line.strip(" |+-") for line in tail.splitlines()]
    return next((line for line in reversed(lines) if line), "empty log")


def _mounted(path: str) -> bool:
    """Whether ``path`` (absolute, as it was mounted) is a mount point, read
    from mountinfo: a stat of it would wait forever on a hung FUSE daemon."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    return any(len(f := line.split()) > 4 and f[4].encode().decode("unicode_escape") == path for line in lines)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as dead
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return Path(f"/proc/{pid}").exists() and "Z" not in _proc_state(pid)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def _signal(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``, which may have ended since it was found alive
    (a daemon of a killed `lab up` can die of its own at any moment)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _reap(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False
