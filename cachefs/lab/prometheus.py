"""A real Prometheus (the ``prometheus`` binary, Debian's package) scraping
every node of a lab and its mount, for ``cachefs lab up --prometheus``.

It keeps its config and data under ``ROOT/prometheus``, logs to
``logs/prometheus.log`` and listens on 127.0.0.1 at the lab's
``prometheus_port``; the lab records its pid and stops it with the nodes.
Targets are labelled with their zone, as docs/prometheus/prometheus.yml does
for the compose cluster, so the same queries and rules work on both; from a
source checkout it also loads that directory's alert rules
(``cachefs-rules.yml``, copied next to the config), so the lab's Prometheus
evaluates the alerts an operator's would. An installed package has no docs/:
then the lab scrapes without rules and logs that.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachefs.lab.cluster import Lab

log = logging.getLogger(__name__)

SCRAPE_INTERVAL = "1s"  # a lab runs for minutes: see a workload as it runs
BINARY = "prometheus"
RULES = Path(__file__).resolve().parents[2] / "docs" / "prometheus" / "cachefs-rules.yml"


class PrometheusUnavailable(Exception):
    pass


def config_text(lab: Lab, rules: str | None = None) -> str:
    """The scrape config: one job per kind, every target with its zone, and the ``rules`` file if any."""
    lines = ["global:", f"  scrape_interval: {SCRAPE_INTERVAL}", f"  evaluation_interval: {SCRAPE_INTERVAL}"]
    if rules:
        lines += ["rule_files:", f"  - {rules}"]
    lines.append("scrape_configs:")
    targets: dict[str, list[tuple[int, str]]] = {}
    for node in lab.nodes:
        if node.metrics_port:
            targets.setdefault(node.kind, []).append((node.metrics_port, node.zone))
    if lab.config.mount_metrics_port:
        targets["mount"] = [(lab.config.mount_metrics_port, "z1")]  # Lab.mount mounts in z1
    for kind, ports in targets.items():
        lines += [f"  - job_name: cachefs-{kind}", "    static_configs:"]
        for port, zone in ports:
            lines += [f'      - targets: ["127.0.0.1:{port}"]', f"        labels: {{zone: {zone}}}"]
    return "\n".join(lines) + "\n"


def start(lab: Lab) -> subprocess.Popen[bytes]:
    """Start Prometheus for ``lab`` and wait until it is ready."""
    binary = shutil.which(BINARY)
    if binary is None:
        raise PrometheusUnavailable("--prometheus needs the prometheus binary (Debian: apt install prometheus)")
    home = Path(lab.root) / "prometheus"
    home.mkdir(parents=True, exist_ok=True)
    rules = None
    if RULES.is_file():
        rules = RULES.name
        shutil.copyfile(RULES, home / rules)
    else:
        log.info("prometheus: no %s here (not a source checkout): scraping without alert rules", RULES)
    (home / "prometheus.yml").write_text(config_text(lab, rules))
    port = lab.config.prometheus_port
    logs = Path(lab.root) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "prometheus.log", "ab") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            tail = (logs / "prometheus.log").read_text(errors="replace").splitlines()[-5:]
            raise PrometheusUnavailable("prometheus did not become ready:\n" + "\n".join(tail))
        time.sleep(0.2)
