"""A real Prometheus scraping a test's Ray head through Ray's own service-discovery file, queried by its HTTP API.

``scripts/test.sh`` installs Debian's ``prometheus`` when it is missing and it can
(root, apt-get); elsewhere ``prometheus_binary()`` skips the test with one line
saying how to run it. The server runs with Ray's generated configuration
(``<session>/metrics/prometheus/prometheus.yml``: one job whose targets are the
file Ray keeps of every node's export port) at a 2 s scrape interval, on a free
loopback port, with its data under the test's folder, and is stopped by its pid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from testbed.ray_head import RayHead, free_port

#: How often the server scrapes (Ray's generated configuration says 10 s).
SCRAPE_INTERVAL_S = 2
START_TIMEOUT_S = 60
HOW_TO_RUN = (
    "prometheus not found: apt-get install prometheus (Debian), or put a Prometheus 2.x on PATH, to run this test"
)


def prometheus_binary() -> str:
    """The ``prometheus`` executable; the calling test is skipped with one line saying how to get it when none."""
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip(HOW_TO_RUN)
    return found


def ray_config(head: RayHead, timeout_s: float = START_TIMEOUT_S) -> str:
    """The Prometheus configuration Ray generated for ``head``'s session (it writes it once its metrics head
    runs), with the scrape interval set to ``SCRAPE_INTERVAL_S``."""
    path = os.path.join(head.temp_dir, "session_latest", "metrics", "prometheus", "prometheus.yml")
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"Ray wrote no Prometheus configuration at {path}"
        time.sleep(0.5)
    with open(path) as f:
        text = f.read()
    assert "file_sd_configs" in text and "prom_metrics_service_discovery.json" in text, text
    return re.sub(r"(scrape_interval|evaluation_interval): \d+s", rf"\1: {SCRAPE_INTERVAL_S}s", text)


@dataclass(frozen=True, slots=True)
class Prometheus:
    """A running server: its address and its HTTP API."""

    url: str

    def api(self, path: str, **params: str | float) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
            doc = json.loads(r.read())
        assert doc.get("status") == "success", doc
        return doc["data"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """Every series ``expr`` yields from ``start`` to ``end`` (Unix seconds), one point per ``step``."""
        data = self.api("query_range", query=expr, start=start, end=end, step=step)
        assert data["resultType"] == "matrix", data
        return data["result"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def targets_up(self) -> list[str]:
        """The scrape targets whose last scrape succeeded."""
        data = self.api("targets")
        return [t["scrapeUrl"] for t in data["activeTargets"] if t["health"] == "up"]


@contextmanager
def prometheus(head: RayHead, folder: str, rules: str = "") -> Iterator[Prometheus]:
    """Prometheus scraping ``head``'s cluster with Ray's configuration, up once it scrapes a target; ``rules``:
    the text of a rule file it evaluates every scrape interval."""
    binary = prometheus_binary()
    os.makedirs(folder, exist_ok=True)
    config = os.path.join(folder, "prometheus.yml")
    with open(config, "w") as f:
        f.write(ray_config(head))
        if rules:
            rule_file = os.path.join(folder, "rules.yml")
            with open(rule_file, "w") as r:
                r.write(rules)
            f.write(f"rule_files:\n  - '{rule_file}'\n")
    port = free_port()
    log = open(os.path.join(folder, "prometheus.log"), "w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={os.path.join(folder, 'data')}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if server.targets_up():
                    break
            except OSError:
                pass
            assert proc.poll() is None, f"prometheus exited {proc.returncode}: see {log.name}"
            assert time.monotonic() < deadline, f"prometheus scraped no target of Ray's file in time: see {log.name}"
            time.sleep(0.5)
        yield server
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
