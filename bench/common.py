"""What every benchmark shares: repeated timing, medians, tables and --json.

These machines are shared and noisy, so a benchmark measures its baseline in
the same run, repeats each case, and reports the median and the ratio to the
baseline rather than a single absolute time.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def wait_for_port(port: int, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    """Until something listens on ``port``; ``proc`` exiting first is an error at once.
    ``timeout`` is a hang guard: on a loaded machine a server alone can take 20 s to start."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listened on port {port} within {timeout}s")


def spawn(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """Start a helper process from the repository root with this Python."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **kwargs.pop("env", {})}
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, **kwargs)


def stop(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def create_volume_once_elected(mc: Any, volume: str, policy: str = "replica:3",
                                     timeout: float = 60.0) -> None:
    """Create ``volume`` through the MetaClient ``mc`` of a cluster just
    started, trying again while it is still electing its first leader."""
    import trio

    from cachefs import commands as C

    with trio.fail_after(timeout):
        while True:
            try:
                await mc.mutate(C.CreateVolume(volume, policy))
                return
            except Exception:  # noqa: BLE001 - the cluster is still electing
                await trio.sleep(0.2)


def print_table(title: str, columns: list[str], rows: list[list[Any]], note: str = "") -> None:
    """A rich table on a terminal or a plain one when piped."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=note or None)
    for col in columns:
        table.add_column(col, justify="right" if col != columns[0] else "left")
    for row in rows:
        table.add_row(*[_fmt(v) for v in row])
    Console(width=max(100, sum(len(c) for c in columns) + 10)).print(table)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
    return str(v)


def emit(result: dict[str, Any], as_json: bool, show: Callable[[], None]) -> None:
    """Print one JSON object with --json, else the human table."""
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        show()
