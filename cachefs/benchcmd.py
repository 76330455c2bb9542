"""``cachefs bench NAME [ARGS]``: run ``python -m bench.NAME`` from the repository."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent


def _names() -> list[str]:
    """Every runnable benchmark: a module of bench/ with a ``main()``."""
    return sorted(p.stem for p in (REPO / "bench").glob("*.py")
                  if not p.stem.startswith("_") and "\ndef main(" in p.read_text())


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("name")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(name: str, args: tuple[str, ...]) -> None:
    """Run a benchmark from bench/ (e.g. `cachefs bench compare --quick`, `cachefs bench rpc_bench --json`)."""
    names = _names()
    if name not in names:
        raise click.BadParameter(f"no benchmark {name!r}; available: {', '.join(names) or 'none'}",
                                 param_hint="NAME")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sys.exit(subprocess.call([sys.executable, "-m", f"bench.{name}", *args], cwd=REPO, env=env))
