"""docs/config.md is what the CLI says: regenerated here and compared."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from cachefs.cli import main
from cachefs.cli.configdoc import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_config_reference_matches_the_cli() -> None:
    assert DOC.read_text() == render(), (
        "docs/config.md is stale: regenerate it with `python -m cachefs.cli.configdoc > docs/config.md`")


def test_every_option_and_its_help_is_in_the_reference() -> None:
    text = DOC.read_text()
    for path, flag, words in (("cachefs datanode", "--capacity SIZE", "Bytes this datanode may store"),
                              ("cachefs volume create", "--policy TEXT", "[default: ec:4+2;"),
                              ("cachefs mount", "--allow-other", "default_permissions")):  # fmt: skip
        section = text.split(f"## `{path}`\n", 1)[1].split("\n## ", 1)[0]
        row = next(line for line in section.splitlines() if line.startswith(f"| `{flag}`"))
        assert words in row, row
        help_text = " ".join(CliRunner().invoke(main, [*path.split()[1:], "--help"]).output.split())
        assert flag in help_text and words in help_text, help_text


def test_the_environment_variables_it_names_set_the_options(monkeypatch) -> None:
    """The auto variables of a nested subcommand, as the reference spells them, really work."""
    text = DOC.read_text()
    assert "`CACHEFS_VOLUME_CREATE_POLICY`" in text and "`CACHEFS_MOUNT_L1_SIZE`" in text
    monkeypatch.setenv("CACHEFS_VOLUME_CREATE_POLICY", "replica:3")
    monkeypatch.setenv("CACHEFS_MOUNT_L1_SIZE", "3G")
    group = main.make_context("cachefs", ["volume", "create", "v", "--meta", "127.0.0.1:1"])
    volume = main.get_command(group, "volume")
    vctx = volume.make_context("volume", ["create", "v", "--meta", "127.0.0.1:1"], parent=group)
    create = volume.get_command(vctx, "create")
    assert create.make_context("create", ["v", "--meta", "127.0.0.1:1"], parent=vctx).params["policy"] == "replica:3"
    mount = main.get_command(group, "mount")
    params = mount.make_context("mount", ["127.0.0.1:1", "v", "/m"], parent=group).params
    assert params["l1_size"] == 3 << 30
