"""Who gets in: the cluster secret on every daemon, POSIX permissions through the mount for
non-root users, and what the metrics and status endpoints give away."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import trio

from cachefs.errors import AuthFailed, CacheFSError
from cachefs.queries import ClusterMap
from cachefs.rpc import RpcPool

USER_A, USER_B = 4242, 4343


@pytest.mark.parametrize("secret", [b"wrong-secret-" + b"x" * 20, None], ids=["wrong-secret", "no-secret"])
def test_every_daemon_refuses_a_client_without_the_secret(small_lab, secret) -> None:
    async def scenario():
        async with RpcPool(secret=secret) as pool:
            for node in small_lab.nodes:
                for method, args in (("health", {}), ("stats", {}), ("cluster_map", {})):
                    with pytest.raises(CacheFSError) as info:
                        await pool.call(node.addr, method, args, timeout=5)
                    assert isinstance(info.value, AuthFailed), (node.name, method, info.value)
        # The right secret still gets in, so the refusals were about the secret.
        async with RpcPool(secret=small_lab.secret) as pool:
            for node in small_lab.nodes:
                assert (await pool.call(node.addr, "health", timeout=5)).result["service"]

    trio.run(scenario)


def test_a_daemon_with_the_wrong_secret_cannot_join(small_lab, tmp_path: Path) -> None:
    """A datanode started with another secret never shows up in the cluster map."""
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    port = small_lab.node("data1").port + 50
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "datanode", "--zone", "z1", "--data-dir",
                             str(tmp_path / "d"), "--capacity", "1G", "--listen", f"127.0.0.1:{port}",
                             "--meta", ",".join(small_lab.meta_addrs), "--node-id", "intruder", "--heartbeat", "0.2",
                             "--secret-file", str(secret)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async def check():
            async with RpcPool(secret=small_lab.secret) as pool:
                meta = small_lab.meta_client(pool, deadline=10)
                await trio.sleep(3)
                cmap = await meta.query(ClusterMap())
                return [n["id"] for n in cmap["datanodes"]]

        assert "intruder" not in trio.run(check)
    finally:
        proc.kill()
        out = proc.communicate(timeout=10)[0].decode(errors="replace")
    assert "authentication failed" in out.lower() or "EAUTH" in out or "secret" in out.lower(), out[-2000:]


# ---------------------------------------------------------------- POSIX permissions


def as_user(uid: int, code: str, *, groups: str = "") -> subprocess.CompletedProcess[str]:
    """Run Python code as another uid/gid (setpriv), printing errno names of failures."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups" if not groups else f"--groups={groups}",
            sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


PRELUDE = """
import errno, os, sys
def t(label, fn, *a):
    try:
        fn(*a)
        print(label, "ok")
    except OSError as e:
        print(label, errno.errorcode[e.errno])
"""


def outcomes(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert result.returncode == 0, result.stderr
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


@pytest.fixture
def area(small_mnt: Path, request) -> Path:
    path = small_mnt / f"perm-{request.node.name}"
    path.mkdir()
    path.chmod(0o755)
    return path


def test_mode_bits_and_ownership(area: Path) -> None:
    (area / "private").write_text("root only")
    (area / "private").chmod(0o600)
    (area / "public").write_text("everyone")
    (area / "public").chmod(0o644)
    (area / "rodir").mkdir(mode=0o755)
    (area / "user").mkdir()
    os.chown(area / "user", USER_A, USER_A)
    r = outcomes(as_user(USER_A, PRELUDE + f"""
d = {str(area)!r}
t("read_private", lambda: open(d + "/private").read())
t("read_public", lambda: open(d + "/public").read())
t("write_public", lambda: open(d + "/public", "a"))
t("create_in_rodir", lambda: open(d + "/rodir/x", "w"))
t("unlink_public", os.unlink, d + "/public")
t("chmod_public", os.chmod, d + "/public", 0o777)
t("chown_public", os.chown, d + "/public", {USER_A}, {USER_A})
t("create_in_own", lambda: open(d + "/user/mine", "w").write("a"))
t("chown_own_to_other", os.chown, d + "/user/mine", {USER_B}, -1)
t("chgrp_own_to_foreign_group", os.chown, d + "/user/mine", -1, 0)
t("chmod_own", os.chmod, d + "/user/mine", 0o600)
t("setuid_bit_own", os.chmod, d + "/user/mine", 0o4755)
"""))
    assert r == {
        "read_private": "EACCES", "read_public": "ok", "write_public": "EACCES", "create_in_rodir": "EACCES",
        "unlink_public": "EACCES", "chmod_public": "EPERM", "chown_public": "EPERM", "create_in_own": "ok",
        "chown_own_to_other": "EPERM", "chgrp_own_to_foreign_group": "EPERM", "chmod_own": "ok",
        "setuid_bit_own": "ok",
    }, r
    st = os.stat(area / "user" / "mine")
    assert (st.st_uid, st.st_gid) == (USER_A, USER_A)  # new files belong to their creator
    assert (area / "private").read_text() == "root only"
    assert (area / "public").read_text() == "everyone"


def test_sticky_directory(area: Path) -> None:
    tmp = area / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    r = outcomes(as_user(USER_A, PRELUDE + f"""
t("create_a", lambda: open({str(tmp)!r} + "/a-file", "w").write("a"))
"""))
    assert r == {"create_a": "ok"}
    r = outcomes(as_user(USER_B, PRELUDE + f"""
d = {str(tmp)!r}
t("unlink_a", os.unlink, d + "/a-file")
t("rename_a", os.rename, d + "/a-file", d + "/stolen")
t("create_b", lambda: open(d + "/b-file", "w").write("b"))
t("unlink_b", os.unlink, d + "/b-file")
"""))
    assert r == {"unlink_a": "EPERM", "rename_a": "EPERM", "create_b": "ok", "unlink_b": "ok"}, r
    assert sorted(os.listdir(tmp)) == ["a-file"]
    assert os.stat(tmp / "a-file").st_uid == USER_A


def test_setgid_directory_and_group_access(area: Path) -> None:
    shared = area / "shared"
    shared.mkdir()
    os.chown(shared, 0, USER_B)
    shared.chmod(0o2770)
    r = outcomes(as_user(USER_A, PRELUDE + f"""
t("list_shared", os.listdir, {str(shared)!r})
"""))
    assert r == {"list_shared": "EACCES"}
    r = outcomes(as_user(USER_A, PRELUDE + f"""
t("create_shared", lambda: open({str(shared)!r} + "/g", "w").write("g"))
""", groups=str(USER_B)))
    assert r == {"create_shared": "ok"}
    assert os.stat(shared / "g").st_gid == USER_B  # inherited from the setgid directory


# ---------------------------------------------------------------- what endpoints give away


def test_metrics_and_status_expose_no_file_names_or_secrets(small_lab, small_mnt: Path) -> None:
    marker = "topsecret-" + secrets.token_hex(6)
    (small_mnt / marker).mkdir()
    (small_mnt / marker / f"{marker}.bin").write_bytes(os.urandom(100_000))
    assert (small_mnt / marker / f"{marker}.bin").stat().st_size == 100_000
    secret = small_lab.secret.decode()
    pages = []
    for node in small_lab.nodes:
        if node.metrics_port:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as resp:
                pages.append((node.name, resp.read().decode()))
    assert len(pages) == len(small_lab.nodes)
    status = subprocess.run([sys.executable, "-m", "cachefs.cli", "status", "--meta", ",".join(small_lab.meta_addrs),
                             "--secret-file", str(small_lab.secret_file), "--json"], capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr
    pages.append(("status", status.stdout + status.stderr))

    async def rpc_views():
        async with RpcPool(secret=small_lab.secret) as pool:
            out = []
            for node in small_lab.nodes:
                for method in ("health", "stats", "meta_status"):
                    try:
                        out.append((f"{node.name}.{method}", repr((await pool.call(node.addr, method, timeout=5))
                                                                   .result)))
                    except CacheFSError as exc:
                        assert exc.code in ("ENOSYS", "EINVAL", "ENOENT"), exc
            return out

    pages += trio.run(rpc_views)
    for name, text in pages:
        assert marker not in text, f"{name} shows a file name"
        assert secret not in text, f"{name} shows the cluster secret"
    log_dir = Path(small_lab.config.root) / "logs"
    for log in log_dir.iterdir():
        assert secret not in log.read_text(errors="replace"), f"{log.name} holds the cluster secret"
