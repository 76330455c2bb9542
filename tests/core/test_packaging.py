"""The distribution: its name, its extras, and a wheel that works in a fresh venv.

The wheel test builds the project with ``pip wheel`` and installs it, with its
dependencies from the registry (pip's cache makes repeated runs quick), into a
new venv without the ``[mount]`` extra: the command, the daemons and the
native API must work there, and the mount must say which extra it needs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from cachefs import DISTRIBUTION, __version__
from cachefs.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_distribution_name_and_extras() -> None:
    project = PYPROJECT["project"]
    assert project["name"] == DISTRIBUTION == "cachefs-ai"  # "cachefs" on PyPI is another project
    assert project["version"] == __version__
    assert not any(Requirement(r).name == "pyfuse3" for r in project["dependencies"])
    assert [Requirement(r).name for r in project["optional-dependencies"]["mount"]] == ["pyfuse3"]
    [torch] = [Requirement(r) for r in project["optional-dependencies"]["torch"] if r.startswith("torch")]
    assert "==" not in str(torch.specifier) and torch.specifier.contains("2.13.0")
    assert torch.specifier.contains("2.14.1")  # not pinned: a newer torch is fine too
    assert set(project["scripts"]) == {"cachefs", "mount.cachefs"}


def test_the_makefile_installs_the_torch_on_disk_first() -> None:
    text = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH\s*\?=\s*torch==2\.13\.0$", text, re.M)
    recipe = text.split("$(VENV)/.installed:", 1)[1].split("\n\n", 1)[0]
    assert recipe.index("install -q '$(TORCH)'") < recipe.index("install -q -e '.[")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # From a copy: setuptools leaves build/ in the tree it builds, and a stale
    # build/lib would put modules deleted since into later wheels.
    src = tmp_path_factory.mktemp("src") / "cachefs"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    [whl] = out.glob("cachefs_ai-*.whl")
    return whl


def test_the_wheel_holds_the_metadata_units_and_scripts(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = zf.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "Name: cachefs-ai" in meta and f"Version: {__version__}" in meta
    assert re.search(r"^Requires-Dist: pyfuse3>=3\.3; extra == \"mount\"$", meta, re.M), meta
    assert "mount.cachefs = cachefs.cli.mounthelper:main" in entry_points
    units = {Path(n).name for n in names if n.startswith("cachefs/systemd/")}
    assert units == {p.name for p in (ROOT / "cachefs" / "systemd").glob("*.service")}


def test_the_wheel_works_in_a_fresh_venv_without_the_mount_extra(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", str(wheel)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    bin_ = venv / "bin"

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)

    assert run(str(bin_ / "cachefs"), "--version").stdout.strip() == f"cachefs, version {__version__}"
    assert run(str(py), "-c", "import pyfuse3").returncode != 0  # the extra is really not there
    assert run(str(py), "-c", "import cachefs.client.api, cachefs.client.adapters.fsspec").returncode == 0
    need = f"needs pyfuse3, which is not installed: pip install '{DISTRIBUTION}[mount]'"
    for argv in ([str(bin_ / "cachefs"), "mount", "127.0.0.1:1", "v", str(tmp_path)],
                 [str(bin_ / "mount.cachefs"), "127.0.0.1:1:v", str(tmp_path), "-o", "ro"]):
        proc = run(*argv)
        assert proc.returncode == 1 and need in proc.stderr, proc.stderr
    listed = run(str(bin_ / "cachefs"), "--help").stdout
    assert "mount" in listed and "metanode" in listed
    # A daemon from the wheel serves, and the wheel's own client reaches it.
    addr = f"127.0.0.1:{free_port()}"
    daemon = subprocess.Popen([str(bin_ / "cachefs"), "datanode", "--zone", "z1", "--data-dir", str(tmp_path / "d"),
                               "--capacity", "1G", "--listen", addr, "--insecure"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while (health := run(str(bin_ / "cachefs"), "health", addr, "--insecure")).returncode != 0:
            assert daemon.poll() is None and time.monotonic() < deadline, health.stderr
            time.sleep(0.2)
        assert '"service": "datanode"' in health.stdout
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=30)
    assert daemon.returncode == 0, err
