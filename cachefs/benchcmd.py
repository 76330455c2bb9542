"""``cachefs bench NAME [ARGS]``: run ``python -m bench.NAME`` from the repository."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent


def _names() -> list[str]:
    bench = REPO / "bench"
    return sorted(p.stem for p in bench.glob("*_bench.py")) + sorted(
        p.stem for p in bench.glob("fio_compare.py"))


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("name")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(name: str, args: tuple[str, ...]) -> None:
    """Run a benchmark from bench/ (e.g. `cachefs bench rpc_bench --json`)."""
    names = _names()
    if name not in names:
        raise click.BadParameter(f"no benchmark {name!r}; available: {', '.join(names) or 'none'}",
                                 param_hint="NAME")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sys.exit(subprocess.call([sys.executable, "-m", f"bench.{name}", *args], cwd=REPO, env=env))
