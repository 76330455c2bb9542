"""Logs of every daemon and the mount: one record per line, as text or JSON.

- ``text``: ``time level component[pid] logger: message``, for people.
- ``json`` (``--log-format json``, python-json-logger): one object per line
  with ``time``, ``level``, ``component``, ``pid``, ``logger``, ``message``
  (and ``exc_info``), for a log shipper (Loki, Elasticsearch, journald's
  JSON readers) to index without parsing.

A log file (``--log-file`` of every daemon and the mount) is a
``WatchedFileHandler``: after logrotate moves it, the next record goes to a
new file at the same path (no ``copytruncate`` needed). SIGHUP
(:func:`with_reload`) reads the log level again from the TOML config file
(``cachefs --config FILE``, the command's ``[table]``, key ``log-level``; the
level the process started with when the file names none) and reopens the log
file. A daemon, and a mount running in the background, also point fds 1 and
2 (tracebacks of the interpreter itself, faulthandler) at the log file, at
start and again on each SIGHUP, so that nothing keeps writing into the
rotated file.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import signal
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click
import trio

log = logging.getLogger(__name__)

FORMATS = ("text", "json")
T = TypeVar("T")


class TextFormatter(logging.Formatter):
    """One line per record: ``time level component[pid] logger: message``."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = (f"{ts}.{int(record.msecs):03d}Z {record.levelname:<7} "
                f"{self.component}[{record.process}] {record.name}: {record.getMessage()}")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def json_formatter(component: str) -> logging.Formatter:
    """``{"time": ISO 8601 UTC, "level", "pid", "logger", "message", "component"}``
    (and ``exc_info``, and whatever a record's ``extra`` adds). Imported only
    when asked for: a venv made before this dependency still logs text."""
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "{levelname}{process}{name}{message}", style="{", timestamp="time",
        rename_fields={"levelname": "level", "process": "pid", "name": "logger"},
        static_fields={"component": component},
    )


@dataclass
class _Setup:
    """What SIGHUP needs to redo: where the level may come from, and the file."""

    level: str
    config_path: str | None = None
    section: str | None = None  # the command's table in the config file
    log_file: str | None = None
    stderr_too: bool = False  # fds 1 and 2 follow log_file (a daemon, a background mount)


_setup: _Setup | None = None


def setup_logging(component: str, level: str = "INFO", fmt: str = "text", log_file: str | None = None,
                  *, stderr_too: bool = False) -> None:
    """Log records of ``level`` and above to stderr, or to ``log_file``.

    ``stderr_too``: point fds 1 and 2 at ``log_file`` as well, now and on
    every SIGHUP (a daemon, a background mount: no terminal to keep).

    Raises:
        OSError: ``log_file`` cannot be opened for appending.
    """
    global _setup
    formatter = json_formatter(component) if fmt == "json" else TextFormatter(component)
    handler: logging.Handler
    if log_file:
        handler = logging.handlers.WatchedFileHandler(log_file)
        if stderr_too:
            _point_stdio_at(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in root.handlers:
        old.close()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    ctx = click.get_current_context(silent=True)
    config_path = section = None
    if ctx is not None:
        config_path = ctx.find_root().params.get("config_path")
        names = []
        while ctx.parent is not None:  # the command's table: [datanode], [volume.create]
            names.append(ctx.info_name or "")
            ctx = ctx.parent
        section = ".".join(reversed(names)) or None
    _setup = _Setup(level.upper(), config_path, section, log_file, stderr_too)


def _point_stdio_at(path: str) -> None:
    """fds 1 and 2 to the end of ``path`` (made if missing)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def configured_level() -> str | None:
    """The ``log-level`` the config file's table for this command names now, if any.

    Raises:
        ValueError: the file cannot be read, is not TOML, or names no level.
    """
    if _setup is None or not _setup.config_path or not _setup.section:
        return None
    try:
        with open(_setup.config_path, "rb") as f:
            data: Any = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"config file {_setup.config_path}: {exc}") from None
    for key in _setup.section.split("."):
        data = data.get(key, {}) if isinstance(data, dict) else {}
    if not isinstance(data, dict):
        return None
    value = data.get("log-level", data.get("log_level"))
    if value is None:
        return None
    if not isinstance(value, str) or logging.getLevelName(value.upper()) not in (10, 20, 30, 40, 50):
        raise ValueError(f"config file {_setup.config_path}: [{_setup.section}] log-level = {value!r} "
                         "is not DEBUG, INFO, WARNING or ERROR")
    return value.upper()


def reload() -> None:
    """SIGHUP: the level from the config file again, and the log file reopened."""
    if _setup is None:
        return
    root = logging.getLogger()
    try:
        level = configured_level() or _setup.level
    except ValueError as exc:
        log.error("SIGHUP: keeping log level %s: %s", logging.getLevelName(root.level), exc)
        level = logging.getLevelName(root.level)
    if _setup.log_file:
        for handler in root.handlers:
            if isinstance(handler, logging.handlers.WatchedFileHandler):
                handler.reopenIfNeeded()
        if _setup.stderr_too:
            try:
                _point_stdio_at(_setup.log_file)
            except OSError as exc:
                log.error("SIGHUP: cannot reopen %s: %s", _setup.log_file, exc.strerror)
    root.setLevel(level)
    log.warning("SIGHUP: log level %s", level)  # at WARNING: seen at every level but ERROR


async def reload_on_sighup() -> None:
    """Run :func:`reload` on every SIGHUP (forever; cancel to stop)."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            reload()


async def with_reload(fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()`` with :func:`reload_on_sighup` beside it: the way every
    daemon runs its trio main (``trio.run(with_reload, main)``)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reload_on_sighup)
        result = await fn()
        nursery.cancel_scope.cancel()
    return result
