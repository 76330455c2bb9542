"""The default metrics ports written in the docs are the ones the code uses.

docs/config.md is generated (cachefs/cli/configdoc.py, checked by
test_configdoc.py); the hand-written docs must spell the list exactly as
``default_ports_text()`` does, and any 956x port they name must be one the code
has, so changing ``DEFAULT_PORTS`` without the docs fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from cachefs.metrics import DEFAULT_PORTS, default_ports_text

ROOT = Path(__file__).resolve().parents[2]
LISTS = ("docs/deploy.md", "docs/prometheus/prometheus.yml", "docs/config.md")


def test_every_doc_that_lists_the_defaults_lists_the_codes() -> None:
    text = default_ports_text()
    assert text.startswith(f"{DEFAULT_PORTS['metanode']} metanode, ")
    for doc in LISTS:
        flat = " ".join((ROOT / doc).read_text().replace("#", " ").split())
        assert text in flat, f"{doc} does not list the default ports as {text!r}"


def test_no_doc_names_a_port_the_code_does_not_have() -> None:
    docs = [*ROOT.glob("docs/**/*.md"), *ROOT.glob("docs/**/*.yml"), ROOT / "README.md",
            *ROOT.glob("cachefs/systemd/*")]
    stale = {f"{p.relative_to(ROOT)}: {port}" for p in docs if p.is_file()
             for port in re.findall(r"\b95[6-9]\d\b", p.read_text()) if int(port) not in DEFAULT_PORTS.values()}
    assert not stale, stale


def test_the_scrape_config_finds_the_mount_at_its_default_port() -> None:
    config = yaml.safe_load((ROOT / "docs/prometheus/prometheus.yml").read_text())
    [mount] = [job for job in config["scrape_configs"] if job["job_name"] == "cachefs-mount"]
    ports = {int(t.rpartition(":")[2]) for s in mount["static_configs"] for t in s["targets"]}
    assert ports == {DEFAULT_PORTS["mount"]}
