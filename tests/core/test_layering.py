"""The dependency rules hold: ``lint-imports`` with the contracts in .importlinter.

The components live in their own top-level folders (metanode/, datanode/,
cachenode/, client/) mapped into the ``cachefs`` namespace by pyproject's
``package-dir``; import-linter reads one package from one directory, so the
test first lays the package out as it installs (symlinks in a temporary
directory) and points the linter there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _installed_layout(root: Path) -> Path:
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = root / "cachefs"
    package.mkdir()
    for entry in (REPO / package_dir["cachefs"]).iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in package_dir.items():
        if name == "cachefs":
            continue
        parent, _, child = name.rpartition(".")
        assert parent == "cachefs", f"package-dir {name}: only components directly under cachefs are laid out"
        (package / child).symlink_to(REPO / folder)
    return root


def test_the_import_contracts_hold(tmp_path: Path) -> None:
    root = _installed_layout(tmp_path)
    lint = "from importlinter.cli import lint_imports_command; lint_imports_command()"  # the lint-imports script
    result = subprocess.run([sys.executable, "-c", lint, "--no-cache", str(REPO / ".importlinter")], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout
