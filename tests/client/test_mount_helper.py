"""``mount.cachefs``: mount(8)'s options, and real mounts through mount(8) and /etc/fstab.

The end-to-end tests run mount(8) itself in a private mount namespace whose
/usr/sbin (/sbin) is an overlay with the helper on top: mount(8) finds
``mount.cachefs`` where it always looks, and nothing outside the namespace
changes, so parallel runs cannot see each other's helper or mounts. The test
reaches the mount through ``/proc/PID/root`` of the namespace's holder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from cachefs.cli.mounthelper import (
    HelperError,
    main,
    mount_argv,
    option_table,
    split_options,
    translate,
)
from cachefs.client.mount import KERNEL_FLAGS, mount_command

# What the mount.cachefs console script runs, from this interpreter (a venv made
# before the script existed lacks it; the wheel test checks the script itself).
HELPER = f"#!/bin/sh\nexec {sys.executable} -m cachefs.cli.mounthelper \"$@\"\n"
TABLE = option_table(mount_command)


def params_of(args: list[str]) -> dict:
    """What the real ``cachefs mount`` makes of these arguments."""
    return mount_command.make_context("mount", ["127.0.0.1:1", "v", "/m", *args]).params


# ---------------------------------------------------------------- the -o table


def test_every_long_option_of_cachefs_mount_is_an_o_option() -> None:
    for param in mount_command.params:
        if isinstance(param, click.Option) and param.name != "background":
            longs = [o[2:] for o in [*param.opts, *param.secondary_opts] if o.startswith("--")]
            assert longs and all(name in TABLE for name in longs), param.name
    assert "background" not in TABLE and "d" not in TABLE


def test_o_options_mean_what_the_command_line_means(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")
    words = ["l1-size=8G", "readahead=64M", f"token-file={token}", "attr-timeout=0.25", "zone=z2",
             "transport=auto", "write-through", "insecure", "allow_other", "metrics-addr=9200",
             "max-background=64", "log-level=debug"]
    cli = ["--l1-size", "8G", "--readahead", "64M", "--token-file", str(token), "--attr-timeout", "0.25",
           "--zone", "z2", "--transport", "auto", "--write-through", "--insecure", "--allow-other",
           "--metrics-addr", "9200", "--max-background", "64", "--log-level", "debug"]
    assert params_of(translate(words, TABLE, KERNEL_FLAGS)) == params_of(cli)
    # A later option wins, as in mount(8); no-X undoes X.
    got = params_of(translate(["write-through", "no-write-through", "l1-size=1G", "l1-size=2G"],
                              TABLE, KERNEL_FLAGS))
    assert got["write_through"] is False and got["l1_size"] == 2 << 30


def test_standard_mount_options() -> None:
    args = translate(["rw", "noatime", "nosuid", "nodev", "noexec", "_netdev", "nofail", "user", "defaults",
                      "noauto", "x-systemd.automount", "comment=cachefs", "relatime"], TABLE, KERNEL_FLAGS)
    got = params_of(args)
    assert got["read_only"] is False and got["mount_flags"] == ("noatime", "nosuid", "nodev", "noexec")
    assert params_of(translate(["ro"], TABLE, KERNEL_FLAGS))["read_only"] is True
    assert params_of(translate(["ro", "rw"], TABLE, KERNEL_FLAGS))["read_only"] is False


@pytest.mark.parametrize("words,message", [
    (["l1size=8G"], "unknown mount option 'l1size'"),
    (["strictatime"], "unknown mount option 'strictatime'"),
    (["--l1-size=8G"], "unknown mount option '--l1-size'"),
    (["l1-size"], "'l1-size' needs a value"),
    (["write-through=yes"], "'write-through' is a flag"),
])  # fmt: skip
def test_bad_options_are_named(words, message) -> None:
    with pytest.raises(HelperError, match=re.escape(message)):
        translate(words, TABLE, KERNEL_FLAGS)


def test_sloppy_ignores_unknown_options_only() -> None:
    assert translate(["bogus=1", "zone=z1"], TABLE, KERNEL_FLAGS, sloppy=True) == ["--zone", "z1"]
    with pytest.raises(HelperError, match="needs a value"):
        translate(["zone"], TABLE, KERNEL_FLAGS, sloppy=True)


def test_quoted_commas_stay_in_one_option() -> None:
    assert split_options('a=1,b="x,y",c') == ["a=1", "b=x,y", "c"]
    with pytest.raises(HelperError, match="unbalanced quote"):
        split_options('a="x')


def test_helper_calling_convention() -> None:
    args, letters = mount_argv(["10.0.0.1:7100,10.0.0.2:7100:data", "/mnt/d", "-s", "-n", "-o",
                                "rw,zone=z1,bogus", "-t", "cachefs"])
    assert args == ["mount", "10.0.0.1:7100,10.0.0.2:7100", "data", "/mnt/d", "--background",
                    "--zone", "z1"]
    assert letters == {"s", "n"}
    for argv, message in ((["nocolon", "/m"], "is not META_ADDRS:VOLUME"), (["h:1:v"], "usage"),
                          (["h:1:v", "/m", "-t", "nfs"], "mounts only cachefs"),
                          (["h:1:v", "/m", "-N", "/proc/1/ns/mnt"], "-N"), (["h:1:v", "/m", "-x"], "-x")):
        with pytest.raises(HelperError, match=re.escape(message)):
            mount_argv(argv)


def test_fake_mount_checks_and_prints(capsys) -> None:
    main(["127.0.0.1:7100:vol", "/mnt/x", "-f", "-o", "l1-size=8G,ro"])
    assert capsys.readouterr().out.strip() == (
        "cachefs mount 127.0.0.1:7100 vol /mnt/x --background --l1-size 8G --read-only")
    with pytest.raises(SystemExit) as info:
        main(["127.0.0.1:7100:vol", "/mnt/x", "-f", "-o", "l1-size=lots"])
    assert info.value.code == 2 and "not a size" in capsys.readouterr().err


def test_mount_flags_are_checked() -> None:
    result = CliRunner().invoke(mount_command, ["127.0.0.1:1", "v", "/m", "--mount-flags", "noexec,lazytime"])
    assert result.exit_code == 2 and "'lazytime' is not a kernel mount flag" in result.output


# ---------------------------------------------------------------- through mount(8)


class Namespace:
    """A private mount namespace (held by a ``sleep``) where mount(8) finds our helper."""

    def __init__(self, root: Path) -> None:
        sbin = root / "sbin"
        sbin.mkdir()
        (sbin / "mount.cachefs").write_text(HELPER)
        (sbin / "mount.cachefs").chmod(0o755)
        self.holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "600"])
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{self.holder.pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            assert time.monotonic() < deadline and self.holder.poll() is None, "unshare did not start"
            time.sleep(0.01)
        self.run("mount", "-t", "overlay", "overlay", "-o", f"lowerdir={sbin}:/usr/sbin", "/usr/sbin")
        self.daemons: list[int] = []
        # Under /tmp itself, so that another user (the allow_other check) can reach it.
        self.mountpoint = Path(tempfile.mkdtemp(prefix="cachefs-helper-mnt-"))
        self.mountpoint.chmod(0o755)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["nsenter", "-t", str(self.holder.pid), "-m", "--", *argv],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        if check:
            assert proc.returncode == 0, f"{argv}: {proc.stdout}{proc.stderr}"
        return proc

    def mount(self, *argv: str) -> int:
        """Run mount(8); returns the pid of the cachefs mount daemon it started."""
        out = self.run("mount", *argv).stdout
        pid = int(re.search(r"cachefs mounted \(pid (\d+)\)", out).group(1))
        self.daemons.append(pid)
        return pid

    def path(self, inside: Path) -> Path:
        return Path(f"/proc/{self.holder.pid}/root{inside}")

    def mountinfo(self, where: Path) -> str | None:
        for line in Path(f"/proc/{self.holder.pid}/mountinfo").read_text().splitlines():
            if line.split()[4] == str(where):
                return line
        return None

    def close(self) -> None:
        for pid in self.daemons:
            if _alive(pid):
                os.kill(pid, 9)
        self.holder.kill()
        self.holder.wait()
        self.mountpoint.rmdir()  # never mounted out here


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        assert time.monotonic() < deadline, f"mount daemon {pid} still runs after umount"
        time.sleep(0.05)


@pytest.fixture
def namespace(tmp_path: Path) -> Iterator[Namespace]:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("needs unshare and nsenter (util-linux)")
    ns = Namespace(tmp_path)
    try:
        yield ns
    finally:
        ns.close()


def test_mount_t_cachefs_and_fstab_through_mount8(cluster, namespace: Namespace, tmp_path: Path) -> None:
    mnt = namespace.mountpoint
    spec = f"{','.join(cluster.meta_addrs)}:lab"
    log = tmp_path / "mount.log"
    common = f"secret-file={cluster.secret_file},zone=z1,log-file={log},attr-timeout=0.5,entry-timeout=0.5"

    # mount -t cachefs, as an operator types it.
    pid = namespace.mount("-t", "cachefs", spec, str(mnt), "-o",
                          f"{common},l1-size=64M,readahead=8M,noatime,noexec,allow_other")
    info = namespace.mountinfo(mnt)
    assert info is not None and " fuse.cachefs cachefs:lab " in info, info
    assert "noatime" in info.split()[5] and "noexec" in info.split()[5], info
    assert "allow_other" in info and "default_permissions" in info, info
    as_other = ("setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "stat", str(mnt))
    namespace.run(*as_other)  # allow_other: another user gets in (and the modes still apply)
    data = os.urandom(3 << 20)
    mine = f"helper-{os.getpid()}"  # the cluster's volume is shared by the other client tests
    (namespace.path(mnt) / mine).mkdir()
    (namespace.path(mnt) / mine / "f").write_bytes(data)
    assert mnt.is_dir() and not os.path.ismount(mnt), "the mount leaked out of the namespace"
    namespace.run("umount", str(mnt))  # what systemd does to stop a mount unit
    _wait_gone(pid)
    assert namespace.mountinfo(mnt) is None

    # An /etc/fstab line with _netdev, mounted the way boot mounts it (mount -a).
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# cachefs\n{spec} {mnt} cachefs _netdev,nofail,{common},ro,x-systemd.mount-timeout=60 0 0\n")
    namespace.run("mount", "--bind", str(fstab), "/etc/fstab")
    out = namespace.run("mount", "-a", "-t", "cachefs").stdout
    pid = int(re.search(r"pid (\d+)", out).group(1))
    namespace.daemons.append(pid)
    info = namespace.mountinfo(mnt)
    assert info is not None and info.split()[5].startswith("ro,"), info
    assert "allow_other" not in info, "allow_other must be asked for"
    proc = namespace.run(*as_other, check=False)
    assert proc.returncode != 0 and "Permission denied" in proc.stderr, proc.stderr
    assert (namespace.path(mnt) / mine / "f").read_bytes() == data
    with pytest.raises(OSError, match="Read-only file system"):
        (namespace.path(mnt) / mine / "g").write_bytes(b"x")
    namespace.run("umount", str(mnt))
    _wait_gone(pid)

    # Unknown options are refused by name, through mount(8), before anything mounts.
    proc = namespace.run("mount", "-t", "cachefs", spec, str(mnt), "-o", f"{common},l1-sise=8G", check=False)
    assert proc.returncode != 0 and "unknown mount option 'l1-sise'" in proc.stderr, proc.stderr
    assert namespace.mountinfo(mnt) is None

    pid = namespace.mount("-t", "cachefs", spec, str(mnt), "-o", common)
    shutil.rmtree(namespace.path(mnt) / mine)
    namespace.run("umount", str(mnt))
    _wait_gone(pid)
    bad = [line for line in log.read_text().splitlines() if " ERROR " in line or line.startswith("Traceback")]
    assert not bad, log.read_text()
