"""docs/prometheus and docs/grafana: promtool accepts the config and the alert
rules, every metric they or a dashboard panel name is one some daemon serves,
and the scrape config scrapes every daemon of the compose file in its zone."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.core.test_metric_names import all_families

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "docs" / "prometheus"
DASHBOARD = ROOT / "docs" / "grafana" / "cachefs.json"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (Debian: apt install prometheus)")


@needs_promtool
@pytest.mark.parametrize("what, path", [("rules", PROMETHEUS / "cachefs-rules.yml"),
                                        ("config", PROMETHEUS / "prometheus.yml")])
def test_promtool_accepts_it(what: str, path: Path) -> None:
    proc = subprocess.run(["promtool", "check", what, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _exprs() -> dict[str, str]:
    out = {}
    for group in yaml.safe_load((PROMETHEUS / "cachefs-rules.yml").read_text())["groups"]:
        for rule in group["rules"]:
            out[f"rule {rule['alert']}"] = rule["expr"]
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            out[f"panel {panel['title']} {target['refId']}"] = target["expr"]
    return out


async def test_every_metric_named_exists_in_some_registry(tmp_path: Path) -> None:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}
    # By type, not by sample: a labelled metric no call has touched yet has no samples.
    served = {f.name + suffix for f in await all_families(tmp_path) for suffix in suffixes.get(f.type, ("",))}
    exprs = _exprs()
    assert len([k for k in exprs if k.startswith("rule")]) >= 5 and len(exprs) >= 20
    missing = {where: name for where, expr in exprs.items()
               for name in re.findall(r"\bcachefs_\w+", expr) if name not in served}
    assert not missing, missing


def test_the_rules_cover_what_an_operator_asks() -> None:
    alerts = " ".join(k for k in _exprs() if k.startswith("rule"))
    for alert in ("LeaderLost", "ZoneDown", "UnderReplicated", "CacheNodeNearFull", "MountErrors"):
        assert alert in alerts, alert


def test_the_scrape_config_scrapes_every_compose_daemon_in_its_zone() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    daemons = {f"{name}:9100": svc["labels"]["cachefs.zone"] for name, svc in compose.items()
               if svc.get("labels", {}).get("cachefs.kind") in ("metanode", "datanode", "cachenode")}
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    scraped = {target: static["labels"]["zone"] for job in config["scrape_configs"]
               for static in job["static_configs"] for target in static["targets"]}
    assert {t: z for t, z in scraped.items() if t.endswith(":9100")} == daemons
    assert "client:9563" in scraped  # the mount, at its default port


def _compose_prometheus() -> tuple[dict, Path]:
    """The compose file's prometheus service and the host file its --config.file names."""
    svc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["prometheus"]
    [config] = [a.split("=", 1)[1] for a in svc["command"] if a.startswith("--config.file=")]
    mounts = {t.split(":")[0]: s for s, t in (v.split(":", 1) for v in svc["volumes"])}
    directory, name = config.rsplit("/", 1)
    assert directory in mounts, f"--config.file {config} is not inside a mounted directory"
    return svc, (ROOT / mounts[directory] / name).resolve()


@needs_promtool
def test_the_compose_prometheus_loads_a_config_promtool_accepts() -> None:
    """promtool resolves rule_files next to the config, so this checks the rules it loads too."""
    svc, config = _compose_prometheus()
    assert config == (PROMETHEUS / "prometheus.yml").resolve()
    proc = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")
def test_the_compose_prometheus_flags_are_real_flags() -> None:
    svc, _ = _compose_prometheus()
    assert svc["command"][0] == "prometheus"
    usage = subprocess.run(["prometheus", "--help"], capture_output=True, text=True, timeout=60)
    known = set(re.findall(r"--([\w.-]+)", usage.stdout + usage.stderr))
    flags = {a[2:].split("=", 1)[0] for a in svc["command"][1:]}
    assert flags and flags <= known, flags - known
