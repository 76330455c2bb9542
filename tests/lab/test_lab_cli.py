"""``cachefs lab`` shows the lab's own errors as click's: a bad argument is a
usage error (exit 2), a step that cannot be done an error (exit 1). Nothing
here creates a namespace: the commands fail before they would."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from cachefs.cli import main
from cachefs.lab import netns
from cachefs.lab.cluster import Lab, LabConfig


def _planned_network(root: Path) -> netns.Network:
    """The state file of a --netns lab's network, planned only."""
    lab = Lab(LabConfig(root=str(root), netns=netns.DEFAULT_SUBNET))
    net = netns.Network.plan(root, netns.DEFAULT_SUBNET, [(n.name, n.zone) for n in lab.nodes])
    net.save()
    return net


def _lab(*args: str):
    return CliRunner().invoke(main, ["lab", *args], prog_name="cachefs")


def test_bad_arguments_are_usage_errors(tmp_path: Path) -> None:
    _planned_network(tmp_path)
    for args, message in [
        (["cut", "z9"], "'z9' is neither a lab node nor a zone"),
        (["latency", "z1", "fast"], "latency 'fast': use a duration"),
        (["loss", "5", "nowhere"], "'nowhere' is neither a lab node nor a zone"),
    ]:
        result = _lab(*args, "--dir", str(tmp_path))
        assert result.exit_code == 2, result.output
        assert f"Usage: cachefs lab {args[0]}" in result.output and f"Error: {message}" in result.output
    result = _lab("up", "--dir", str(tmp_path / "new"), "--netns", "--subnet", "8.8.8.0/24")
    assert result.exit_code == 2 and "Error: subnet 8.8.8.0/24 is not a private range" in result.output


def test_what_cannot_be_done_is_an_error_naming_it(tmp_path: Path) -> None:
    result = _lab("status", "--dir", str(tmp_path))
    assert result.exit_code == 1
    assert result.output == f"Error: no lab in {tmp_path} (no lab.json); start one with `cachefs lab up`\n"
    net = _planned_network(tmp_path)
    net.prefix = "eth"  # a state file naming interfaces that are not the lab's
    net.save()
    result = _lab("heal", "--dir", str(tmp_path))
    assert result.exit_code == 1 and "is not a lab prefix; not touching it" in result.output
