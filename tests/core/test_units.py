"""The systemd units and the deployment guide's examples, checked against systemd and the real CLI.

No systemd runs as PID 1 where these tests run, so the units are checked the
ways that need none: ``systemd-analyze verify`` (syntax, every key known,
every program executable), ``systemd-analyze security --offline`` (the
hardening), systemd's own fstab generator on the guide's fstab line, and every
command line the units hold parsed by the real click commands with the
environment files the guide shows (docs/deploy.md), as systemd would expand
them. What the daemons tell systemd (READY=1, the watchdog) is tested with
real daemons in test_sdnotify.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cachefs
from cachefs.cli.mounthelper import mount_argv
from cachefs.testing.cliparse import parse_cachefs

ROOT = Path(__file__).resolve().parents[2]
UNITS = Path(cachefs.__file__).parent / "systemd"
DEPLOY = ROOT / "docs" / "deploy.md"
CACHEFS = "/usr/local/bin/cachefs"  # where the units expect the command (docs/deploy.md)
INSTANCES = {"metanode": "1", "datanode": "disk1", "cachenode": "nvme0", "mount": "mnt-data"}
# Options that give a service a mount namespace of its own: a FUSE mount made there is invisible to the host.
OWN_NAMESPACE = {"ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts", "PrivateNetwork",
                 "PrivateUsers", "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
                 "ProtectControlGroups", "ProtectProc", "ProcSubset", "ReadWritePaths", "ReadOnlyPaths",
                 "InaccessiblePaths", "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "MountFlags",
                 "RootDirectory", "RootImage", "StateDirectory", "NetworkNamespacePath"}  # fmt: skip
needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                           reason="systemd-analyze is not installed (Debian: systemd)")


def unit_path(kind: str) -> Path:
    return UNITS / f"cachefs-{kind}@.service"


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """section -> [(key, value)], keys in order and repeated as systemd allows."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: not KEY=VALUE: {raw!r}"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], key: str) -> list[str]:
    return [v for k, v in unit["Service"] if k == key]


def expand_specifiers(text: str, instance: str) -> str:
    unescaped = instance.replace("-", "/")
    table = {"i": instance, "I": unescaped, "f": "/" + unescaped, "H": "host1", "%": "%"}

    def one(m: re.Match[str]) -> str:
        assert m.group(1) in table, f"unit specifier %{m.group(1)} is not one this test knows"
        return table[m.group(1)]

    return re.sub(r"%(.)", one, text)


def documented_files() -> dict[str, str]:
    """``/etc/cachefs/...`` -> the example of it in docs/deploy.md (code blocks headed by its path)."""
    files = {}
    for block in re.findall(r"```[a-z]*\n(.*?)```", DEPLOY.read_text(), re.S):
        first, _, rest = block.partition("\n")
        if first.startswith("# /etc/"):
            files[first[2:].strip()] = rest
    return files


def env_of(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"not KEY=VALUE: {line!r}"
            env[key.strip()] = value.strip()
    return env


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A stand-in for this host's /etc/cachefs, holding the files the examples name."""
    etc = tmp_path / "etc-cachefs"
    etc.mkdir()
    (etc / "secret").write_text("s3cret\n")
    (etc / "datasets.token").write_text("t0ken\n")
    (etc / "datasets.cred").write_text('{"key_id": "client:train:datasets", "key": "00"}\n')
    return etc


def localize(text: str, host: Path) -> str:
    return text.replace("/etc/cachefs/", f"{host}/")


def unit_environment(unit, instance: str, host: Path) -> dict[str, str]:
    docs = documented_files()
    env: dict[str, str] = {}
    for value in values(unit, "EnvironmentFile"):
        optional = value.startswith("-")
        path = expand_specifiers(value.lstrip("-"), instance)
        if path not in docs:
            assert optional, f"EnvironmentFile={path} has no example in docs/deploy.md"
            continue
        env.update({k: localize(v, host) for k, v in env_of(docs[path]).items()})
    return env


def command_lines(unit, instance: str, env: dict[str, str]) -> list[list[str]]:
    """Every Exec*= line as systemd runs it: prefixes dropped, specifiers and ${VAR} expanded."""
    lines = []
    env = {**env, "MAINPID": "1"}  # systemd's own, in ExecReload
    for key in ("ExecStartPre", "ExecStart", "ExecStartPost", "ExecReload", "ExecStop", "ExecStopPost"):
        for value in values(unit, key):
            words = shlex.split(expand_specifiers(value.lstrip("-@+!:"), instance))
            argv = []
            for word in words:
                assert not re.search(r"\$(?!\{)", word), f"{key}: unbraced ${word}: systemd would split it"
                for name in re.findall(r"\$\{(\w+)\}", word):
                    assert name in env, f"{key}: ${{{name}}} is not set by the unit's EnvironmentFile examples"
                argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
            lines.append(argv)
    return lines


# ---------------------------------------------------------------- the CLI accepts every command line


@pytest.mark.parametrize("kind", INSTANCES)
def test_every_command_line_is_accepted_by_the_real_cli(kind, host: Path, monkeypatch) -> None:
    unit = parse_unit(unit_path(kind))
    instance = INSTANCES[kind]
    env = unit_environment(unit, instance, host)
    parsed = []
    for argv in command_lines(unit, instance, env):
        if argv[0] == CACHEFS:
            parsed.append(parse_cachefs(["cachefs", *argv[1:]], env, monkeypatch))
        else:
            assert os.access(argv[0], os.X_OK), f"{argv[0]} is not an executable on this machine"
    [daemon] = parsed
    assert daemon.path == [kind]
    p = daemon.params
    state = [f"/var/lib/{expand_specifiers(v, instance)}" for v in values(unit, "StateDirectory")]
    if kind == "metanode":
        assert p["node_id"] == 1 and p["data_dir"] in state
        assert p["peers"].startswith("1=") and p["secret_file"] == f"{host}/secret"
    elif kind == "datanode":
        assert p["data_dir"] in state and p["zone"] == "z1" and len(p["meta"]) == 3
        assert p["listen"].startswith("0.0.0.0:") and p["advertise"]
    elif kind == "cachenode":
        assert p["cache_dir"] in state and p["zone"] == "z1" and len(p["meta"]) == 3
        assert p["listen"].startswith("0.0.0.0:") and p["advertise"] and p["memory"] == 16 << 30
    else:
        assert p["mountpoint"] == "/mnt/data" and p["volume"] == "datasets" and len(p["meta_addrs"]) == 3
        assert p["allow_other"] is True and p["background"] is False  # Type=notify: the mount is the main process
        assert p["token_file"] == f"{host}/datasets.token" and p["l1_size"] == 8 << 30
        assert p["secret_file"] == f"{host}/datasets.cred"  # a client credential, never the cluster secret


def test_the_guides_fstab_line_is_accepted(host: Path) -> None:
    fstab = documented_files()["/etc/fstab"]
    [line] = [x for x in fstab.splitlines() if x.strip() and not x.startswith("#")]
    spec, where, fstype, options, *_ = localize(line, host).split()
    assert fstype == "cachefs"
    args, _ = mount_argv([spec, where, "-o", options])
    from cachefs.client.mount import mount_command

    params = mount_command.make_context("mount", args[1:]).params
    assert params["background"] and params["allow_other"] and params["zone"] == "z1"
    assert params["secret_file"] == f"{host}/datasets.cred"


# ---------------------------------------------------------------- systemd's view


def installed_copies(tmp_path: Path) -> list[str]:
    """The units as they would be installed here: /usr/local/bin/cachefs is this venv's command."""
    real = Path(sys.executable).parent / "cachefs"
    for kind in INSTANCES:
        text = unit_path(kind).read_text()
        assert CACHEFS in text, kind
        (tmp_path / unit_path(kind).name).write_text(text.replace(CACHEFS, str(real)))
    return [f"cachefs-{kind}@{instance}.service" for kind, instance in INSTANCES.items()]


@needs_systemd_analyze
def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    names = installed_copies(tmp_path)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *names], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and not proc.stdout and not proc.stderr, proc.stdout + proc.stderr


@needs_systemd_analyze
def test_the_daemons_are_hardened(tmp_path: Path) -> None:
    names = installed_copies(tmp_path)
    for name in names:
        # In tenths: the daemons rate 1.5 ("OK"); the mount, root with CAP_SYS_ADMIN, 5.3.
        limit = 60 if name.startswith("cachefs-mount@") else 20
        proc = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--threshold={limit}",
                               "--no-pager", name], cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, f"{name}: exposure over {limit / 10}:\n{proc.stdout[-600:]}{proc.stderr}"


@pytest.mark.parametrize("kind", INSTANCES)
def test_units_are_notify_watched_restarted_and_confined(kind) -> None:
    unit = parse_unit(unit_path(kind))
    assert values(unit, "ExecReload") == ["/bin/kill -HUP ${MAINPID}"]  # cachefs/logs.py: reload, not stop
    assert values(unit, "Type") == ["notify"] and values(unit, "NotifyAccess") == ["main"]
    assert values(unit, "WatchdogSec") and values(unit, "Restart") == ["on-failure"]
    assert values(unit, "NoNewPrivileges") == ["yes"]
    keys = {k for k, _ in unit["Service"]}
    if kind == "mount":
        assert not keys & OWN_NAMESPACE, f"the mount would be invisible to the host: {keys & OWN_NAMESPACE}"
        assert values(unit, "DeviceAllow") == ["/dev/fuse rw"] and values(unit, "DevicePolicy") == ["closed"]
        assert values(unit, "CapabilityBoundingSet") == ["CAP_SYS_ADMIN"]
    else:
        assert values(unit, "User") == ["cachefs"] and values(unit, "CapabilityBoundingSet") == [""]
        assert values(unit, "ProtectSystem") == ["strict"]


@pytest.mark.skipif(not os.path.exists("/usr/lib/systemd/system-generators/systemd-fstab-generator"),
                    reason="systemd's fstab generator is not installed")  # fmt: skip
def test_fstab_line_with_netdev_becomes_a_remote_mount(tmp_path: Path) -> None:
    """systemd turns the guide's fstab line into a mount unit under remote-fs.target (after the
    network), and the same line without _netdev into a local one, which would hang the boot."""
    fstab = documented_files()["/etc/fstab"]

    def generate(text: str) -> Path:
        out = tmp_path / f"gen{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        (tmp_path / "fstab").write_text(text)
        env = {**os.environ, "SYSTEMD_FSTAB": str(tmp_path / "fstab"), "SYSTEMD_PROC_CMDLINE": ""}
        subprocess.run(["/usr/lib/systemd/system-generators/systemd-fstab-generator", str(out), str(out), str(out)],
                       env=env, check=True, capture_output=True, timeout=30)  # fmt: skip
        return out

    out = generate(fstab)
    assert (out / "remote-fs.target.wants" / "mnt-data.mount").exists()
    unit = (out / "mnt-data.mount").read_text()
    assert "Type=cachefs" in unit and "Where=/mnt/data" in unit
    if shutil.which("systemd-analyze"):
        proc = subprocess.run(["systemd-analyze", "verify", "--man=no", "mnt-data.mount"], cwd=out,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0 and not proc.stderr, proc.stderr
    local = generate(fstab.replace("_netdev,", ""))
    assert (local / "local-fs.target.wants" / "mnt-data.mount").exists()


def test_units_ship_in_the_package() -> None:
    assert sorted(p.name for p in UNITS.glob("*.service")) == sorted(unit_path(k).name for k in INSTANCES)
