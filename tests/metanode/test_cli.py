"""The metanode's command-line surface: bad input gets a clear error naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner

from cachefs.metanode.admin import volume
from cachefs.metanode.daemon import command
from cachefs.rpc import RpcPool
from cachefs.testing.metacluster import MetaCluster


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--id", "4", "--peers", "1=127.0.0.1:1,2=127.0.0.1:2,3=127.0.0.1:3"],
            "not one of the ids",
        ),
        (["--id", "1", "--peers", "1=127.0.0.1"], "must be host:port"),
        (["--id", "1", "--peers", "x=127.0.0.1:5"], "ID=host:port"),
        (["--id", "1", "--peers", "1=127.0.0.1:5,1=127.0.0.1:6"], "given twice"),
        (["--id", "0", "--peers", "1=127.0.0.1:5"], "--id"),
        (["--id", "1", "--peers", "1=127.0.0.1:5", "--lease-term", "0.5"], "'--lease-term': 0.5 is not in the range"),
    ],
)
def test_metanode_rejects_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(command, [*args, "--data-dir", str(tmp_path), "--insecure"])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_volume_create_validates_before_calling() -> None:
    runner = CliRunner()
    bad = runner.invoke(
        volume, ["create", "v", "--policy", "raid5", "--meta", "127.0.0.1:1", "--insecure"]
    )
    assert bad.exit_code == 2 and "policy" in bad.output
    bad = runner.invoke(
        volume, ["create", "v", "--block-size", "3M", "--meta", "127.0.0.1:1", "--insecure"]
    )
    assert bad.exit_code == 2 and "block" in bad.output


async def test_volume_commands_against_real_metanodes(tmp_path: Path) -> None:
    cluster = MetaCluster(tmp_path)
    cluster.start_all()
    try:
        async with RpcPool(secret=None) as pool:
            await cluster.wait_leader(pool)
        meta = ",".join(cluster.addrs)
        cli = [sys.executable, "-m", "cachefs.cli", "volume"]

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*cli, *args, "--meta", meta, "--insecure"],
                text=True,
                capture_output=True,
                timeout=60,
            )

        made = await trio.to_thread.run_sync(
            lambda: run(
                "create",
                "data",
                "--policy",
                "ec:4+2",
                "--compression",
                "zstd",
                "--block-size",
                "1M",
            )
        )
        assert made.returncode == 0, made.stderr
        again = await trio.to_thread.run_sync(lambda: run("create", "data"))
        assert again.returncode == 1 and "EEXIST" in again.stderr
        changed = await trio.to_thread.run_sync(lambda: run("set", "data", "--compression", "none"))
        assert changed.returncode == 0, changed.stderr
        listed = await trio.to_thread.run_sync(lambda: run("list", "--json"))
        vols = json.loads(listed.stdout)
        assert vols["data"]["policy"] == "ec:4+2" and vols["data"]["block_size"] == 1 << 20
        assert vols["data"]["compression"] == "none" and vols["data"]["used_inodes"] == 1
        quota = await trio.to_thread.run_sync(
            lambda: run("quota", "data", "1", "--max-inodes", "5")
        )
        assert json.loads(quota.stdout)["max_inodes"] == 5
    finally:
        cluster.stop_all()
