"""Lab start-up errors name what is wrong before (or as) anything dies."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cachefs.lab.cluster import Lab, LabConfig, LabError, _last_line
from cachefs.testing.ports import free_lab_base


def test_a_taken_port_is_named_and_nothing_starts(tmp_path: Path) -> None:
    config = LabConfig(root=str(tmp_path / "lab"), metanodes=1, datanodes=3, cachenodes=1, zones=3, metrics=False)
    base = config.base_port = free_lab_base(config)
    lab = Lab(config)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + 101))
        squatter.listen()
        with pytest.raises(LabError, match=rf"127.0.0.1:{base + 101} \(data1\) is in use"):
            lab.up(timeout=5)
    assert all(node.pid is None for node in lab.nodes)


def test_the_dying_line_of_a_trio_traceback_is_quoted(tmp_path: Path) -> None:
    log = tmp_path / "data1.log"
    log.write_text("starting\n  |     raise exc\n  | OSError: [Errno 98] Address already in use\n"
                   "  +------------------------------------\n")
    assert _last_line(log) == "OSError: [Errno 98] Address already in use"
    assert _last_line(tmp_path / "missing.log") == "no log"
