"""docs/config.md, the configuration reference, generated from the click commands.

    python -m cachefs.cli.configdoc > docs/config.md

Every subcommand (groups recursively) gets its usage line, its help and one
row per option: the option as ``--help`` shows it, its help with default and
range exactly as ``--help`` renders them, and the environment variable that
sets it. The test suite regenerates the file and compares, so the reference
cannot drift from the CLI.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator

import click

from cachefs.cli import NeedsExtra, main
from cachefs.metrics import default_ports_text

HEADER = """\
# Configuration reference

Generated from the CLI by `python -m cachefs.cli.configdoc > docs/config.md`; the
test suite checks that it matches. Do not edit by hand.

Every option can be given three ways; the first one found wins:

1. on the command line: `cachefs datanode --capacity 2T`;
2. in the environment: the variable in the table (`CACHEFS_DATANODE_CAPACITY=2T`).
   The shared ones (`CACHEFS_SECRET_FILE`, `CACHEFS_LOG_LEVEL`, `CACHEFS_METRICS_ADDR`,
   `CACHEFS_TLS_*`, ...) serve every subcommand that has the option;
3. in a TOML file given with `cachefs --config FILE` (or `CACHEFS_CONFIG`): one table
   per subcommand, keys spelled as the long option without its dashes
   (`[datanode]` / `capacity = "2T"`; `[volume.create]` for `cachefs volume create`).

Besides the options: `CACHEFS_SECRET` holds the cluster secret itself (instead of a
file), `CACHEFS_METRICS_HOST` the address `/metrics` is served on when `--metrics-addr`
gives only a port (default 127.0.0.1; `/metrics` is on by default, at
{ports}), `CACHEFS_RUN_DIR` where mounts keep their pid files (default /run/cachefs).
Sizes take binary units (`4096`, `64M`, `1.5G`, `2TiB`). `mount.cachefs` (mount(8) and
/etc/fstab) takes every `cachefs mount` option as `-o name=value`, a flag as `-o name`.
"""


def commands(group: click.Group, ctx: click.Context) -> Iterator[tuple[click.Context, click.Command]]:
    """Every subcommand of ``group``, depth first, each with its own context."""
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        sub = click.Context(command, info_name=name, parent=ctx, **command.context_settings)  # as click makes it
        yield sub, command
        if isinstance(command, click.Group):
            yield from commands(command, sub)


def envvar(param: click.Option, ctx: click.Context) -> str:
    if param.envvar:
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
        return ", ".join(f"`{n}`" for n in names)
    if param.allow_from_autoenv and ctx.auto_envvar_prefix and param.name:
        return f"`{ctx.auto_envvar_prefix}_{param.name.upper()}`"
    return ""


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_command(ctx: click.Context, command: click.Command) -> str:
    path = ctx.command_path
    out = [f"## `{path}`", ""]
    if isinstance(command, NeedsExtra):
        raise SystemExit(f"{path}: its optional dependency is not installed; generate with every extra")
    if command.help:
        paragraphs = inspect.cleandoc(command.help).replace("\b\n", "").split("\n\n")
        out += [p for para in paragraphs for p in (" ".join(para.split()), "")]
    pieces = command.collect_usage_pieces(ctx)
    out += [f"Usage: `{path} {' '.join(pieces)}`", ""]
    rows = []
    for param in command.get_params(ctx):
        if not isinstance(param, click.Option) or param.hidden or set(param.opts) & set(ctx.help_option_names):
            continue
        record = param.get_help_record(ctx)
        if record is None:
            continue
        rows.append(f"| `{cell(record[0])}` | {cell(record[1])} | {envvar(param, ctx)} |")
    if rows:
        out += ["| option | meaning | environment |", "|---|---|---|", *rows, ""]
    return "\n".join(out)


def render() -> str:
    root = click.Context(main, info_name="cachefs", auto_envvar_prefix="CACHEFS", terminal_width=10_000)
    sections = [render_command(ctx, command) for ctx, command in commands(main, root)]
    return HEADER.replace("{ports}", default_ports_text()) + "\n" + "\n".join(sections)


if __name__ == "__main__":
    sys.stdout.write(render())
