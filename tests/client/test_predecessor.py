"""The session record a mount leaves for the next mount at its mount point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cachefs.client import predecessor as P
from cachefs.client.mount import session_record


def test_a_record_round_trips_and_names_a_live_or_a_gone_process(tmp_path: Path) -> None:
    assert session_record(tmp_path / "mnt") == session_record(str(tmp_path / "mnt"))
    path = tmp_path / "run" / "mnt.session.json"
    mine = P.Record.of_this_process("client/7", "vol")
    assert P.write(path, mine) and P.read(path) == mine
    assert not P.crashed(mine)
    assert P.crashed(P.Record("client/7", "vol", mine.pid, mine.started + 1))  # the pid, reused

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = P.process_started(child.pid)
    assert started is not None or child.poll() is not None
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert P.process_started(child.pid) is None
    child.wait()

    P.remove(path, "client/8")  # another session's: kept
    assert P.read(path) == mine
    P.remove(path, "client/7")
    assert P.read(path) is None


def test_a_record_that_is_not_ours_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    for text in ("", "{", "[]", '{"session": 1, "volume": "v", "pid": 2, "started": 3}',
                 '{"session": "s", "volume": "v", "pid": true, "started": 3}', '{"session": "s"}'):
        path.write_text(text)
        assert P.read(path) is None, text
    (tmp_path / "file").write_text("not a directory")  # the run directory cannot be made
    assert not P.write(tmp_path / "file" / "r.json", P.Record.of_this_process("s", "v"))
