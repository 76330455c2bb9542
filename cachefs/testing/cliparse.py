"""Command lines parsed by the real click commands, as the process that runs them would parse them.

For files that hold ``cachefs ...`` lines (docker-compose.yml, the systemd
units): every option's type, range and requirement is checked by click
itself, with the environment the line would run under.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import click

from cachefs.cli import main
from cachefs.config import DaemonGroup


@dataclass
class Parsed:
    path: list[str]  # ["datanode"] or ["volume", "create"]
    params: dict[str, Any]


def parse_cachefs(argv: list[str], env: dict[str, str], monkeypatch: Any) -> Parsed:
    """Parse ``cachefs ...`` under exactly ``env`` (set through pytest's ``monkeypatch``).

    Raises click.UsageError (missing or bad options) like the real command.
    """
    assert argv[0] == "cachefs", argv
    for key in [k for k in os.environ if k.startswith("CACHEFS_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ctx = click.Context(main, info_name="cachefs", **main.context_settings)
    command: click.Command = main
    args, path = argv[1:], []
    while isinstance(command, click.Group):
        if command.invoke_without_command and command is not main and (
                not args or command.get_command(ctx, args[0]) is None):
            ctx = ctx.parent or ctx  # a group that runs by itself (metanode): parse it
            break
        assert args, f"{' '.join(argv)}: no subcommand"
        name, args = args[0], args[1:]
        sub = command.get_command(ctx, name)
        if sub is None:
            raise click.UsageError(f"no such command {name!r}")
        path.append(name)
        command = sub
        if isinstance(command, click.Group):
            ctx = click.Context(command, info_name=name, parent=ctx)
    sub_ctx = command.make_context(path[-1], list(args), parent=ctx)
    if isinstance(command, DaemonGroup) and command is not main:  # it runs by itself: what that needs
        command.check_run(sub_ctx)
    return Parsed(path, dict(sub_ctx.params))
