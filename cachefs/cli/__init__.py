"""The ``cachefs`` command: one subcommand per job.

Subcommands live next to the code they run and are imported only when used,
so ``cachefs mount`` does not pay for importing the metanode. The table below
is the one place that says which module provides which subcommand. A command
whose wiring would make a shared-core module import a component (repair,
gc, info and fsck build a metanode client; mount.cachefs drives the mount) lives in this
package instead.

A subcommand whose module needs an optional dependency that is not installed
(pyfuse3, for the mount) still shows in ``--help`` and, when run, says which
extra to install instead of failing with a traceback.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from cachefs import DISTRIBUTION, __version__
from cachefs.config import load_toml, validate_section

SUBCOMMANDS: dict[str, str] = {
    "metanode": "cachefs.metanode.daemon:command",
    "datanode": "cachefs.datanode.daemon:command",
    "cachenode": "cachefs.cachenode.daemon:command",
    "volume": "cachefs.metanode.admin:volume",
    "quota": "cachefs.metanode.admin:quota_group",
    "dump": "cachefs.metanode.admin:dump",
    "load": "cachefs.metanode.admin:load",
    "mount": "cachefs.client.mount:mount_command",
    "umount": "cachefs.client.mount:umount_command",
    "warmup": "cachefs.cachenode.warmup:command",
    "repair": "cachefs.cli.repair:command",
    "gc": "cachefs.cli.gc:command",
    "info": "cachefs.cli.info:command",
    "fsck": "cachefs.cli.fsck:command",
    "stats": "cachefs.cli.stats:command",
    "status": "cachefs.status:status",
    "health": "cachefs.status:health",
    "lab": "cachefs.lab.cli:lab",
    "bench": "cachefs.benchcmd:bench",
    "credential": "cachefs.cli.credential:credential",
    "repo": "cachefs.cli.repo:repo",
    "import": "cachefs.cli.ingest:command",
    "tree": "cachefs.cli.tree:tree",
}

# Optional dependencies: the module a failed import names -> (the extra that installs it, a note).
EXTRAS: dict[str, tuple[str, str]] = {
    "pyfuse3": ("mount", "pyfuse3 compiles against libfuse3: apt install gcc pkg-config libfuse3-dev fuse3"),
}


def _load(name: str) -> click.Command | None:
    module_name, _, attr = SUBCOMMANDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None  # not part of this build
        if exc.name in EXTRAS:
            return NeedsExtra(name, exc.name, *EXTRAS[exc.name])
        raise
    return getattr(module, attr)


class NeedsExtra(click.Command):
    """The stand-in for a subcommand whose optional dependency is not installed."""

    def __init__(self, name: str, module: str, extra: str, note: str) -> None:
        install = f"pip install '{DISTRIBUTION}[{extra}]'"
        self.reason = f"cachefs {name} needs {module}, which is not installed: {install} ({note})"
        super().__init__(
            name, callback=self.refuse, params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
            context_settings={"ignore_unknown_options": True},
            help=f"Not installed here: needs the [{extra}] extra ({install}).",
        )  # fmt: skip

    def refuse(self, args: tuple[str, ...]) -> None:
        raise click.ClickException(self.reason)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in SUBCOMMANDS if _load(name) is not None)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in SUBCOMMANDS:
            return None
        return _load(cmd_name)


def _section_defaults(path: str, name: str, table: dict[str, Any], command: click.Command,
                      ctx: click.Context) -> dict[str, Any]:
    if isinstance(command, click.Group):
        out: dict[str, Any] = {}
        own: dict[str, Any] = {}  # a group that runs by itself (metanode) has options too
        for key, value in table.items():
            sub = command.get_command(ctx, key) if isinstance(value, dict) else None
            if sub is not None:
                out[key] = validate_section(path, f"{name}.{key}", value, sub, ctx)
            elif command.invoke_without_command and not isinstance(value, dict):
                own[key] = value
            else:
                raise click.UsageError(f"config file {path}: [{name}] has unknown table or key {key!r}")
        return {**out, **validate_section(path, name, own, command, ctx)}
    return validate_section(path, name, table, command, ctx)


@click.group(cls=LazyGroup, context_settings={"auto_envvar_prefix": "CACHEFS", "help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), envvar="CACHEFS_CONFIG",
              help="TOML file with a [subcommand] table of option defaults.")
@click.version_option(__version__, prog_name="cachefs")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """cachefs: a distributed cache filesystem for AI training data."""
    if config_path:
        data = load_toml(config_path)
        unknown = sorted(set(data) - set(SUBCOMMANDS))
        if unknown:
            raise click.UsageError(f"config file {config_path}: unknown table [{unknown[0]}] "
                                   f"(tables are subcommand names: {', '.join(sorted(SUBCOMMANDS))})")
        name = ctx.invoked_subcommand
        command = _load(name) if name else None
        if command is not None and name in data:
            # Subcommand contexts inherit default_map[name]: flags and
            # environment variables still win over these values.
            ctx.default_map = {name: _section_defaults(config_path, name, data[name], command, ctx)}
