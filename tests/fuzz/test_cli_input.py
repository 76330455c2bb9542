"""Bad CLI and config input: one clear message naming the problem, the usage exit code 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "cachefs.cli"]


def cachefs(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def one_error(result: subprocess.CompletedProcess[str], *must_name: str) -> str:
    out = result.stdout + result.stderr
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, out
    for word in must_name:
        assert word in errors[0], (word, errors[0])
    return errors[0]


@pytest.mark.parametrize(("toml", "named"), [
    ('[datanode]\nzone = "z1"\nbogus_key = 3\n', ["bogus_key"]),
    ('[datanode]\nzone = "z1"\nheartbeat = "fast"\n', ["heartbeat", "fast"]),
    ('[datanode]\nzone = "z1"\ncapacity = [1, 2]\n', ["capacity"]),
    ('[datanode\nzone = "z1"\n', ["config"]),
    ('[no-such-command]\nx = 1\n', ["no-such-command"]),
])
def test_bad_config_file(tmp_path: Path, toml: str, named: list[str]) -> None:
    cfg = tmp_path / "cachefs.toml"
    cfg.write_text(toml)
    result = cachefs("--config", str(cfg), "datanode", "--data-dir", str(tmp_path / "d"), "--capacity", "1G",
                     "--insecure")
    assert result.returncode == 2, result.stdout + result.stderr
    one_error(result, *named)
    assert not (tmp_path / "d").exists()  # refused before doing anything


@pytest.mark.parametrize(("args", "named"), [
    (["datanode", "--zone", "z", "--capacity", "lots"], ["--capacity", "lots"]),
    (["datanode", "--zone", "z", "--capacity", "1G", "--listen", "nohost"], ["--listen", "nohost"]),
    (["datanode", "--zone", "z", "--capacity", "1G", "--listen", "127.0.0.1:99999"], ["--listen"]),
    (["datanode", "--zone", "z", "--capacity", "-5G"], ["--capacity"]),
    (["cachenode", "--zone", "z", "--capacity", "1G", "--memory", "1Q"], ["--memory"]),
    (["metanode", "--id", "0", "--peers", "1=127.0.0.1:1"], ["--id"]),
    (["metanode", "--id", "1", "--peers", "garbage"], ["--peers"]),
])
def test_bad_options(tmp_path: Path, args: list[str], named: list[str]) -> None:
    flag = "--cache-dir" if args[0] == "cachenode" else "--data-dir"
    result = cachefs(*args, flag, str(tmp_path / "d"), "--insecure")
    assert result.returncode == 2, result.stdout + result.stderr
    one_error(result, *named)


def test_environment_variable_of_the_wrong_type(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}, "CACHEFS_DATANODE_HEARTBEAT": "soon"}
    result = subprocess.run([*CLI, "datanode", "--zone", "z", "--capacity", "1G", "--data-dir", str(tmp_path / "d"),
                             "--insecure"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    one_error(result, "soon")


def test_unreachable_metanodes_named_clearly(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    result = cachefs("status", "--meta", "127.0.0.1:1", "--secret-file", str(secret), "--timeout", "1")
    assert result.returncode == 2
    one_error(result, "127.0.0.1:1")


def test_missing_secret_is_a_usage_error(tmp_path: Path) -> None:
    result = cachefs("datanode", "--zone", "z", "--capacity", "1G", "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 2, result.stdout + result.stderr
    one_error(result, "secret")
