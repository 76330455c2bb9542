"""A mount's record of its session, so that the next mount at the same mount
point can end the session of one that crashed.

A mount killed with -9 leaves its metadata session open on the metanodes
until it has been silent for a minute, and its leases until they lapse (a
lease term): a change by anyone to what it held waits that long, and the
files it held open are kept until then. When the mount is restarted at the
same mount point (systemd, an operator, a training job's launcher), the new
mount knows better. It finds the record the old one left beside its pid
file (``cachefs mount``'s run directory), checks that the process that
wrote it is gone (by pid and start time, so a reused pid is not taken for
it), and ends that session with ``CloseSession``, which the leader allows
only to the identity that opened it. A clean unmount removes its record; a
record that cannot be read is ignored (it only ever saves time). A session
the mount opens later (after a long partition expired the first) is not
recorded: a crash then leaves the metanodes to expire it, as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Record:
    """Who serves a mount point: its session, and its process."""

    session: str
    volume: str
    pid: int
    started: int  # the process's start time (clock ticks after boot, /proc/PID/stat)

    @classmethod
    def of_this_process(cls, session: str, volume: str) -> Record:
        pid = os.getpid()
        return cls(session, volume, pid, process_started(pid) or 0)


def process_started(pid: int) -> int | None:
    """Start time of process ``pid`` (None: there is none, or it is a zombie:
    a killed mount daemon stays one until init reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the name may hold spaces and parentheses
    try:
        if fields[0] in ("Z", "X"):  # the state, field 3 of proc(5)
            return None
        return int(fields[19])  # the start time, field 22
    except (IndexError, ValueError):
        return None


def read(path: Path) -> Record | None:
    """The record at ``path``, or None (none there, or not one we wrote)."""
    try:
        raw = json.loads(path.read_text())
        record = Record(raw["session"], raw["volume"], raw["pid"], raw["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    types = (str, str, int, int)
    if not all(type(v) is t for v, t in zip(asdict(record).values(), types, strict=True)):
        return None
    return record


def crashed(record: Record) -> bool:
    """The process that wrote ``record`` is gone."""
    return process_started(record.pid) != record.started


def write(path: Path, record: Record) -> bool:
    """Keep ``record`` at ``path`` (replacing any); False if the directory is
    not writable here (a mount by an unprivileged user: then no record)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(record), f)
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("no session record at %s: %s", path, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()
        return False
    return True


def remove(path: Path, session: str) -> None:
    """Remove the record at ``path`` if it is still ``session``'s (a clean unmount)."""
    record = read(path)
    if record is not None and record.session == session:
        with contextlib.suppress(OSError):
            path.unlink()
