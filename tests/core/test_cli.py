"""The `cachefs` command: help everywhere, config precedence, clear errors."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from cachefs.cli import SUBCOMMANDS, _load, main
from cachefs.config import parse_size
from cachefs.errors import InvalidArgument


def _all_commands():
    for name in SUBCOMMANDS:
        command = _load(name)
        assert command is not None, f"subcommand {name} is listed but its module is missing"
        yield [name], command
        if isinstance(command, click.Group):
            for sub in command.list_commands(click.Context(command)):
                yield [name, sub], command.get_command(click.Context(command), sub)


@pytest.mark.parametrize("path", [p for p, _ in _all_commands()], ids=lambda p: " ".join(p))
def test_every_subcommand_has_help(path):
    result = CliRunner().invoke(main, [*path, "--help"], prog_name="cachefs")
    assert result.exit_code == 0, result.output
    assert "Usage: cachefs " + " ".join(path) in result.output


def test_unknown_subcommand_is_named():
    result = CliRunner().invoke(main, ["frobnicate"])
    assert result.exit_code == 2 and "No such command 'frobnicate'" in result.output


@pytest.mark.parametrize("text,value", [("4096", 4096), ("4k", 4096), ("64M", 64 << 20), ("64MiB", 64 << 20),
                                        ("1.5G", 3 << 29), ("2T", 2 << 40), (123, 123)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "4X", "1e9"])
def test_bad_sizes_are_named(text):
    with pytest.raises(InvalidArgument, match="not a size"):
        parse_size(text)


def test_daemon_refuses_to_start_without_a_secret(monkeypatch):
    monkeypatch.delenv("CACHEFS_SECRET", raising=False)
    result = CliRunner().invoke(main, ["health", "127.0.0.1:9"])
    assert result.exit_code == 2
    assert "no cluster secret" in result.output and "--insecure" in result.output


def test_config_file_unknown_table_key_and_bad_value_are_named(tmp_path):
    runner = CliRunner()
    cfg = tmp_path / "c.toml"
    cfg.write_text('[nosuch]\nx = 1\n')
    result = runner.invoke(main, ["--config", str(cfg), "health", "127.0.0.1:9"])
    assert result.exit_code == 2 and "unknown table [nosuch]" in result.output

    cfg.write_text('[health]\ntimout = 1\n')
    result = runner.invoke(main, ["--config", str(cfg), "health", "127.0.0.1:9"])
    assert result.exit_code == 2 and "[health] has unknown key 'timout'" in result.output

    cfg.write_text('[health]\ntimeout = "soon"\n')
    result = runner.invoke(main, ["--config", str(cfg), "health", "127.0.0.1:9"])
    assert result.exit_code == 2 and "[health] timeout = 'soon'" in result.output

    cfg.write_text('[datanode]\ncapacity = "lots"\n')
    result = runner.invoke(main, ["--config", str(cfg), "datanode", "--help"])
    assert result.exit_code == 2 and "[datanode] capacity = 'lots'" in result.output and "not a size" in result.output

    cfg.write_text('not toml [')
    result = runner.invoke(main, ["--config", str(cfg), "health", "127.0.0.1:9"])
    assert result.exit_code == 2 and "not valid TOML" in result.output


def test_flags_beat_environment_beat_config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEFS_SECRET", "s")
    cfg = tmp_path / "c.toml"
    cfg.write_text('[status]\nmeta = "127.0.0.1:1"\n')
    runner = CliRunner()

    def used(args, env=None):
        result = runner.invoke(main, ["--config", str(cfg), "status", "--timeout", "0.3", *args], env=env or {})
        assert result.exit_code == 2, result.output
        return result.output.split("cluster map from ", 1)[1].split(":", 2)[:2]

    assert used([]) == ["127.0.0.1", "1"]
    assert used([], {"CACHEFS_STATUS_META": "127.0.0.1:2"}) == ["127.0.0.1", "2"]
    assert used(["--meta", "127.0.0.1:3"], {"CACHEFS_STATUS_META": "127.0.0.1:2"}) == ["127.0.0.1", "3"]


def test_bad_addresses_are_named():
    result = CliRunner().invoke(main, ["health", "nohost", "--insecure"])
    assert result.exit_code == 2 and "host:port" in result.output and "'nohost'" in result.output


def test_bench_lists_every_benchmark_and_names_an_unknown_one():
    result = CliRunner().invoke(main, ["bench", "nope"], prog_name="cachefs")
    assert result.exit_code == 2 and "no benchmark 'nope'" in result.output
    for name in ("compare", "rpc_bench", "chaos", "dataloader_bench", "fio_compare"):
        assert name in result.output
