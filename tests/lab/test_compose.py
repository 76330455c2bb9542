"""docker-compose.yml and the Dockerfile, checked against the real code.

No Docker engine runs where these tests run, so everything short of starting
containers is checked here: every command line in the compose file (service
commands, shell scripts, healthchecks) parses with the real click commands
under that service's environment, the environment variables and volumes they
reference exist, the topology is the one `cachefs lab up` starts, and the
Dockerfile copies every package directory the distribution needs.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from cachefs.config import parse_size
from cachefs.lab import s3demo
from cachefs.lab.cluster import VOLUME, Lab, LabConfig
from cachefs.metrics import DEFAULT_PORTS, MetricsAddr
from cachefs.testing.cliparse import Parsed, parse_cachefs

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DAEMON_KINDS = ("metanode", "datanode", "cachenode")
SHELL_OPERATORS = {"&&", "||", "|", ";"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict[str, Any]]:
    return compose["services"]


# ---------------------------------------------------------------- helpers

def env_file_vars(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            out[key.strip()] = value.strip()
    return out


def service_env(svc: dict[str, Any]) -> dict[str, str]:
    """What the container's processes see: env_file(s), then environment."""
    env: dict[str, str] = {}
    files = svc.get("env_file", [])
    for name in [files] if isinstance(files, str) else files:
        path = ROOT / name
        assert path.is_file(), f"env_file {name} does not exist"
        env.update(env_file_vars(path))
    environment = svc.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    env.update({k: str(v) for k, v in environment.items()})
    return env


def expand(word: str, env: dict[str, str], where: str) -> str:
    """Shell-expand ``$$VAR`` (compose's escape for the container's ``$VAR``)."""
    def var(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in env, f"{where}: ${name} is not set in the service's environment or env_file"
        return env[name]

    return re.sub(r"\$\$(?:\{(\w+)\}|(\w+))", var, word)


def command_lines(svc: dict[str, Any], where: str) -> list[list[str]]:
    """The argv of every program the service runs (a ``sh -c`` script split at operators)."""
    cmd = svc.get("command")
    if cmd is None:
        return []
    argv = shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]
    env = service_env(svc)
    if argv[:2] != ["sh", "-c"]:
        return [[expand(a, env, where) for a in argv]]
    lexer = shlex.shlex(argv[2], posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    lines: list[list[str]] = [[]]
    for token in lexer:
        if token in SHELL_OPERATORS:
            lines.append([])
        else:
            assert token not in {"&", "|&", ">", "<"}, f"{where}: unexpected shell token {token!r}"
            lines[-1].append(expand(token, env, where))
    assert all(lines), f"{where}: empty command in {argv[2]!r}"
    return lines


def all_parsed(services, monkeypatch) -> dict[str, list[Parsed]]:
    out: dict[str, list[Parsed]] = {}
    for name, svc in services.items():
        env = service_env(svc)
        out[name] = [parse_cachefs(argv, env, monkeypatch)
                     for argv in command_lines(svc, name) if argv[0] == "cachefs"]
    return out


def daemon(parsed: dict[str, list[Parsed]], name: str) -> Parsed:
    [p] = [p for p in parsed[name] if p.path[0] in DAEMON_KINDS]
    return p


def host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


# ---------------------------------------------------------------- command lines

def test_every_command_line_parses_with_the_real_cli(services, monkeypatch):
    programs = set()
    for name, svc in services.items():
        env = service_env(svc)
        lines = command_lines(svc, name)
        assert lines, f"service {name} has no command"
        health = svc.get("healthcheck", {}).get("test")
        if health:
            assert health[0] == "CMD", f"{name}: healthcheck must be exec form"
            lines.append(health[1:])
        for argv in lines:
            programs.add(argv[0])
            if argv[0] == "cachefs":
                try:
                    parse_cachefs(argv, env, monkeypatch)
                except click.ClickException as exc:
                    pytest.fail(f"service {name}: `{shlex.join(argv)}` does not parse: {exc.format_message()}")
    assert programs <= {"cachefs", "fio", "grep", "prometheus", "python", "weed", "wget"}, f"unexpected {programs}"


def test_the_s3_demo_links_the_lab_s_demo_bucket(services, monkeypatch):
    """The s3-demo job fills the bucket `lab up --s3` fills and links it where the lab does."""
    job = services["s3-demo"]
    lines = command_lines(job, "s3-demo")
    [fill] = [argv for argv in lines if argv[0] == "python"]
    assert fill[1:3] == ["-m", "cachefs.lab.s3demo"]
    endpoint = fill[fill.index("--endpoint") + 1]
    [link] = [parse_cachefs(argv, service_env(job), monkeypatch) for argv in lines if argv[0] == "cachefs"]
    assert link.path == ["repo", "link"] and link.params["volume"] == VOLUME and link.params["path"] == "/demo"
    assert link.params["url"].rstrip("/") + "/" == f"s3://{s3demo.DEMO_BUCKET}/{s3demo.DEMO_PREFIX}"
    s3 = services["s3"]
    assert link.params["endpoint"] == endpoint == f"http://{s3['hostname']}:8333"
    assert "-s3.port=8333" in s3["command"] and "-s3.config=/etc/seaweedfs/s3.json" in s3["command"]
    # the store's one identity is the one every daemon and the job read from s3-credentials.env
    config = json.loads((ROOT / "docs" / "seaweedfs" / "s3.json").read_text())
    [identity] = [c for i in config["identities"] for c in i["credentials"]]
    keys = env_file_vars(ROOT / "s3-credentials.env")
    assert (identity["accessKey"], identity["secretKey"]) == (keys["AWS_ACCESS_KEY_ID"], keys["AWS_SECRET_ACCESS_KEY"])
    for name, svc in services.items():
        if svc.get("labels", {}).get("cachefs.kind") in (*DAEMON_KINDS,) or name in ("s3-demo", "s3-volume"):
            assert service_env(svc)["AWS_ACCESS_KEY_ID"] == keys["AWS_ACCESS_KEY_ID"], name


def test_the_s3_volume_job_creates_the_lab_s_s3_backed_volume(services, monkeypatch):
    """As `lab up --s3`: the volume lab-s3 keeps its blocks under s3://blocks/lab-s3/ of
    the bucket the s3-demo job creates, and the client's credential may mount it."""
    job = services["s3-volume"]
    parsed = [parse_cachefs(argv, service_env(job), monkeypatch)
              for argv in command_lines(job, "s3-volume") if argv[0] == "cachefs"]  # fmt: skip
    [create] = [p for p in parsed if p.path == ["volume", "create"]]
    assert create.params["name"] == s3demo.S3_VOLUME and create.params["backing"] == s3demo.S3_VOLUME_BACKING
    assert create.params["endpoint"] == f"http://{services['s3']['hostname']}:8333"
    assert "s3-demo" in job["depends_on"]  # which makes the bucket


def test_the_validator_rejects_what_the_cli_rejects(services, monkeypatch):
    data = services["data1"]
    [argv] = command_lines(data, "data1")
    env = service_env(data)
    parse_cachefs(argv, env, monkeypatch)
    env.pop("CACHEFS_DATANODE_ZONE")
    with pytest.raises(click.MissingParameter) as missing:
        parse_cachefs(argv, env, monkeypatch)
    assert "'--zone'" in missing.value.format_message()  # as the CLI prints it
    with pytest.raises(click.NoSuchOption):
        parse_cachefs([*argv, "--no-such-flag"], service_env(data), monkeypatch)
    with pytest.raises(click.BadParameter):
        parse_cachefs([*argv, "--capacity", "lots"], service_env(data), monkeypatch)
    with pytest.raises(AssertionError, match="NOPE"):
        command_lines({"command": ["sh", "-c", "cachefs status --meta $$NOPE"]}, "x")


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (make setup installs it)")
def test_fio_job_parses(services):
    [fio] = [argv for argv in command_lines(services["client"], "client") if argv[0] == "fio"]
    job = [a if not a.startswith("--directory=") else "--directory=/tmp" for a in fio]
    result = subprocess.run([*job, "--parse-only"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "--verify=crc32c" in fio and "--do_verify=1" in fio


def test_no_host_side_interpolation():
    """``$VAR`` in compose is read from the host's shell: every variable comes from cachefs.env instead."""
    bare = re.findall(r"(?<!\$)\$(?!\$)\{?\w+", COMPOSE.read_text())
    assert not bare, f"host-interpolated variables {bare}: use env_file or $$ escapes"


def test_only_the_daemons_hold_the_secret_and_the_rest_a_least_credential(services, monkeypatch):
    """Daemons (and the job that issues credentials) get the cluster secret
    from an env file; the volume job an admin credential, the client a client
    credential for the lab's volume, each from its own volume and nothing more."""
    issued = {}
    job = services["credentials"]
    for line in command_lines(job, "credentials"):
        p = parse_cachefs(line, service_env(job), monkeypatch)
        issued[p.params["output"]] = (p.params["role"], tuple(p.params["volumes"]))
    for name, svc in services.items():
        env = service_env(svc)
        assert "--insecure" not in str(svc.get("command")), f"{name} runs insecure"
        if name in ("volume-init", "client", "s3-demo", "s3-volume"):
            assert "CACHEFS_SECRET" not in env, f"{name} must not get the cluster secret"
            (volume,) = [v for v in svc.get("volumes", []) if v.endswith(":/credentials:ro")]
            path = env["CACHEFS_SECRET_FILE"]
            role, volumes = issued[f"/credentials/{volume.split('-')[0]}/{path.rsplit('/', 1)[1]}"]
            assert (name, role, volumes) in {("volume-init", "admin", ()), ("s3-demo", "admin", ()),
                                             ("s3-volume", "admin", ()),
                                             ("client", "client", (VOLUME, s3demo.S3_VOLUME))}  # fmt: skip
            continue
        if name in ("prometheus", "s3"):  # /metrics and the object store need no credential of ours
            assert not env and "env_file" not in svc, f"{name} must not get the cluster secret"
            continue
        secret = env.get("CACHEFS_SECRET", "")
        assert re.fullmatch(r"[0-9a-f]{64}", secret), f"{name}: CACHEFS_SECRET missing or not 32 random bytes in hex"


# ---------------------------------------------------------------- topology

def test_topology_matches_the_lab(services, monkeypatch, tmp_path):
    parsed = all_parsed(services, monkeypatch)
    lab = Lab(LabConfig(root=str(tmp_path)))
    labels = {name: svc.get("labels", {}) for name, svc in services.items()}
    want = {(n.name, n.kind, n.zone) for n in lab.nodes}
    got = {(name, lab_["cachefs.kind"], lab_.get("cachefs.zone", ""))
           for name, lab_ in labels.items() if lab_.get("cachefs.kind") in DAEMON_KINDS}
    want_daemons = {(name, kind) for name, kind, _ in want}
    assert {(name, kind) for name, kind, _ in got} == want_daemons
    for name, kind, zone in want:
        p = daemon(parsed, name)
        assert p.path == [kind], f"{name} runs {p.path}, the lab runs {kind}"
        if kind != "metanode":
            assert p.params["zone"] == zone == labels[name]["cachefs.zone"], name
            assert p.params["node_id"] == name
    # Metanodes: one per zone, each peer list the same, addresses are service names.
    metas = {name: daemon(parsed, name) for name, kind, _ in want if kind == "metanode"}
    peer_lists = {p.params["peers"] for p in metas.values()}
    assert len(peer_lists) == 1
    peers = dict(item.split("=") for item in peer_lists.pop().split(","))
    assert {f"meta{i}" for i in peers} == set(metas)
    assert {labels[m]["cachefs.zone"] for m in metas} == {n.zone for n in lab.nodes if n.zone}
    meta_addrs = sorted(peers.values())
    for name, p in metas.items():
        assert p.params["node_id"] == int(name.removeprefix("meta"))
        assert host_port(peers[str(p.params["node_id"])]) == (name, host_port(p.params["listen"])[1])
    # Data and cache nodes: capacities as in the lab; they advertise their own service name.
    for name, kind, _ in want:
        p = daemon(parsed, name)
        if kind == "metanode":
            continue
        assert sorted(p.params["meta"]) == meta_addrs, name
        assert host_port(p.params["advertise"]) == (name, host_port(p.params["listen"])[1])
        capacity = lab.config.data_capacity if kind == "datanode" else lab.config.cache_capacity
        assert p.params["capacity"] == parse_size(capacity), name
        if kind == "cachenode":
            assert p.params["memory"] == parse_size(lab.config.cache_memory)
    # The volume job creates the lab's volume with the lab's policy.
    [create] = [p for p in parsed["volume-init"] if p.path == ["volume", "create"]]
    assert create.params["name"] == VOLUME and create.params["policy"] == lab.config.policy
    assert sorted(create.params["meta"]) == meta_addrs
    [mount] = [p for p in parsed["client"] if p.path == ["mount"]]
    assert mount.params["volume"] == VOLUME and sorted(mount.params["meta_addrs"]) == meta_addrs
    assert mount.params["zone"] == labels["client"]["cachefs.zone"] == "z1"  # Lab.mount's zone
    assert mount.params["cache_dir"] and mount.params["cache_size"] > 0  # an L2, as Lab.mount gives


def test_healthchecks_ask_the_daemon_itself(services, monkeypatch):
    parsed = all_parsed(services, monkeypatch)
    for name, svc in services.items():
        kind = svc.get("labels", {}).get("cachefs.kind")
        if kind == "storage":  # the S3 store: its own health endpoint
            assert svc["healthcheck"]["test"][1:] == ["wget", "-q", "-O", "/dev/null", "http://127.0.0.1:8333/healthz"]
            continue
        if kind not in DAEMON_KINDS:
            assert "healthcheck" not in svc
            continue
        test = svc["healthcheck"]["test"]
        assert test[1:3] == ["cachefs", "health"], name
        listen_port = host_port(daemon(parsed, name).params["listen"])[1]
        assert host_port(test[3])[1] == listen_port, f"{name}: healthcheck asks the wrong port"


def test_dependencies_and_restart_policies(services):
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            jobs = ("volume-init", "credentials", "s3-demo")
            want = "service_completed_successfully" if dep in jobs else "service_healthy"
            assert cond["condition"] == want, f"{name} -> {dep}"
        kind = svc.get("labels", {}).get("cachefs.kind")
        restart = svc.get("restart")
        if kind in (*DAEMON_KINDS, "monitoring", "storage"):
            assert restart in {"always", "unless-stopped"}, name
        elif kind == "job":
            assert restart == "on-failure", name
        else:
            assert restart == "no", name
    assert set(services["client"]["depends_on"]) >= {"volume-init"}
    assert all(f"data{i}" in services["volume-init"]["depends_on"] for i in range(1, 7))


def test_client_can_mount_fuse(services):
    client = services["client"]
    assert "/dev/fuse" in [d.split(":")[0] for d in client["devices"]]
    assert "SYS_ADMIN" in client["cap_add"]
    assert "apparmor:unconfined" in client["security_opt"]


# ---------------------------------------------------------------- volumes and ports

def test_named_volumes(compose, services, monkeypatch):
    parsed = all_parsed(services, monkeypatch)
    declared = set(compose.get("volumes") or {})
    used: dict[str, str] = {}
    credentials = {}  # a credential's volume: written by the credentials job, read by one service
    for name, svc in services.items():
        for spec in svc.get("volumes", []):
            source, _, target = spec.partition(":")
            target = target.split(":")[0]
            if (name, source) in (("prometheus", "./docs/prometheus"), ("s3", "./docs/seaweedfs")):
                assert spec.endswith(":ro"), f"{name}: its config is mounted read-only"
                continue  # config from the repository, not state
            assert not source.startswith(("/", ".")), f"{name}: bind mount {spec}; use a named volume"
            assert source in declared, f"{name}: volume {source} is not declared"
            if source.endswith("-credential"):
                assert name == "credentials" or spec.endswith(":ro"), f"{name} may write {source}"
                credentials.setdefault(source, []).append(name)
                continue
            assert source not in used, f"volume {source} is shared by {used[source]} and {name}"
            used[source] = name
            if name in ("prometheus", "s3"):
                assert target == {"prometheus": "/prometheus", "s3": "/data"}[name], f"{name} keeps its data in a volume"
                continue
            p = daemon(parsed, name)
            data_dir = p.params.get("data_dir") or p.params.get("cache_dir")
            assert str(data_dir) == target, f"{name}: data dir {data_dir} is not the volume {target}"
    assert set(used) | set(credentials) == declared, f"declared but unused: {declared - set(used)}"
    assert all(len(users) >= 2 and "credentials" in users for users in credentials.values()), credentials
    daemons = [n for n, s in services.items() if s.get("labels", {}).get("cachefs.kind") in DAEMON_KINDS]
    assert sorted(used.values()) == sorted([*daemons, "prometheus", "s3"]), "every daemon keeps its state in a volume"


def test_metrics_ports(services, monkeypatch):
    parsed = all_parsed(services, monkeypatch)
    host_ports = []
    for name, svc in services.items():
        if svc.get("labels", {}).get("cachefs.kind") not in DAEMON_KINDS:
            continue
        addr = daemon(parsed, name).params["metrics_addr"]
        assert addr.explicit, f"{name} has no --metrics-addr"
        assert addr.host == "0.0.0.0", f"{name}: metrics not published beyond the container"
        metrics = addr.port
        [mapping] = svc["ports"]
        published, container = (int(x) for x in str(mapping).split(":"))
        assert container == metrics, name
        host_ports.append(published)
    assert len(set(host_ports)) == len(host_ports), "two services publish the same host port"
    # The mount: its default port on every interface, where the prometheus service scrapes client:9563.
    [mount] = [p for p in parsed["client"] if p.path == ["mount"]]
    assert not mount.params["no_metrics"]
    assert mount.params["metrics_addr"] == MetricsAddr("0.0.0.0", DEFAULT_PORTS["mount"], explicit=False)


# ---------------------------------------------------------------- image

def test_dockerfile_copies_every_package_dir(services):
    text = (ROOT / "Dockerfile").read_text()
    copied = set()
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            for src in words[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
                copied.add(src.rstrip("/"))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs | {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    assert re.search(r"apt-get install .*\bfuse3\b", text) and "fio" in text
    ours = [svc for name, svc in services.items() if name not in ("prometheus", "s3")]
    images = {svc.get("image") for svc in ours}
    builds = {svc.get("build") for svc in ours}
    assert images == {"cachefs:lab"} and builds == {"."}
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["s3"]["image"].startswith("chrislusf/seaweedfs:")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_the_image_build_step_makes_a_complete_wheel(tmp_path):
    """`pip wheel .` on exactly what the Dockerfile copies: every subcommand's module is in it."""
    src = tmp_path / "src"
    src.mkdir()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            for name in words[1:-1]:
                path = ROOT / name
                if path.is_dir():
                    shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
                else:
                    shutil.copy(path, src / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(tmp_path / "out"), str(src)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    [wheel] = (tmp_path / "out").glob("cachefs_ai-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    from cachefs.cli import SUBCOMMANDS

    for target in SUBCOMMANDS.values():
        module = target.partition(":")[0]
        assert module.replace(".", "/") + ".py" in names or module.replace(".", "/") + "/__init__.py" in names, module
    assert "cachefs = cachefs.cli:main" in entry_points
