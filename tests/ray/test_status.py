"""What an operator sees of a live run: `rayckpt status` (a subprocess, as a user runs it) against a cluster
without rayckpt and during a run whose saves commit, wait in flight and fail, and the checkpoint age
on the metrics export port across saves.

One `ray start --head` cluster for the module (Ray's metrics export every second); the run's saves
come from a driver the test steers (``tests.helpers.status_driver``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.helpers.ray_head import ROOT, get, ray_head

pytestmark = pytest.mark.slow

RAYCKPT = os.path.join(ROOT, ".venv", "bin", "rayckpt")
#: Ray's export interval here (it floors it at 1 s); the age gauge is exported at most this late.
EXPORT_S = 1.0
#: How far behind the truth the age gauge may read when the machine is loaded (the actor sets it every second).
STALE_S = 5.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = {"RAY_metrics_report_interval_ms": str(int(EXPORT_S * 1000))}
    with ray_head(str(tmp_path_factory.mktemp("ray")), extra_env=env) as head:
        yield head


def status(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RAYCKPT, "status", "--address", cluster.address, *args],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class Driver:
    """The steered driver: ``ask("save 3")`` -> its JSON answer."""

    def __init__(self, cluster, root: str, gate: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.status_driver", cluster.address, root, gate],
            cwd=ROOT,
            env=cluster.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the driver ended (exit {self.proc.wait()}) on {line!r}"
        return json.loads(answer)

    def close(self) -> None:
        try:
            self.ask("quit") if self.proc.poll() is None else None
        except (AssertionError, BrokenPipeError, json.JSONDecodeError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def driver(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    d = Driver(cluster, str(tmp / "live"), str(tmp / "gate"))
    yield d
    d.close()


def test_a_cluster_without_rayckpt_is_one_line_and_exit_1(cluster):
    done = status(cluster)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "rayckpt status: no rayckpt on this Ray cluster (no 'rayckpt-metadata' actor has published a status): "
        "nothing has saved or restored with rayckpt here yet"
    ]


def test_nothing_answering_at_the_address_is_one_line_and_exit_1(tmp_path):
    from tests.helpers.ray_head import free_port

    done = subprocess.run(
        [RAYCKPT, "status", "--address", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert "does not answer" in done.stderr and "Traceback" not in done.stderr


def published(cluster, want, what: str, limit_s: float = 30.0) -> dict:
    """``rayckpt status --json`` once ``want(report)`` holds (the actors publish every second)."""
    deadline = time.monotonic() + limit_s
    while True:
        done = status(cluster, "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        if want(report):
            return report
        assert time.monotonic() < deadline, f"{what}: not in rayckpt status within {limit_s}s: {report}"
        time.sleep(0.3)


def live(report: dict) -> dict | None:
    return next((r for r in report["runs"] if r["run"] == "live"), None)


def test_status_shows_committed_in_flight_and_failed_saves(cluster, driver):
    assert driver.ask("save 1")["status"] == "committed"
    committed_at = driver.ask("save 2")["committed_at"]
    report = published(
        cluster, lambda r: (live(r) or {}).get("tiers", {}).get("storage", {}).get("step") == 2, "step 2"
    )
    newest = live(report)["tiers"]["storage"]
    assert abs(newest["committed_at"] - committed_at) < 0.5 and newest["path"].endswith("rayckpt-step-00000002")
    assert 0 <= newest["age_s"] < 60 and report["nodes"] and report["nodes"][0]["budget"] > 0

    held = driver.ask("hold 3")["held"]
    writing = lambda r: any(s["phase"].startswith("writing") for s in live(r)["in_flight"])  # noqa: E731
    report = published(cluster, writing, "the held save, registered")
    (flying,) = live(report)["in_flight"]
    assert (flying["save_id"], flying["tier"], flying["step"]) == (held, "storage", 3)
    assert flying["phase"] == "writing (0 of 1 ranks written)"
    text = status(cluster)
    assert text.returncode == 0
    assert re.search(
        r"^  in flight: storage step 3, writing \(0 of 1 ranks written\), for \d+\.\d s$", text.stdout, re.M
    )
    assert re.search(r"^  storage  newest step 2, committed .* ago  .*rayckpt-step-00000002$", text.stdout, re.M)

    assert driver.ask("fail its worker group died")["failed"] == [held]
    report = published(cluster, lambda r: bool(live(r)["failures"]) and not live(r)["in_flight"], "the failure")
    (failure,) = live(report)["failures"]
    assert failure["step"] == 3 and failure["tier"] == "storage" and "its worker group died" in failure["error"]
    assert "failed: " in driver.ask("release")["released"]
    text = status(cluster).stdout
    assert re.search(r"^  failed .* ago: storage step 3: .*its worker group died", text, re.M), text


def scrape(cluster, name: str) -> dict[str, float]:
    """``name``'s samples of run ``live`` on the export port: tier -> value."""
    out = {}
    for line in get(cluster.metrics).splitlines():
        if line.startswith(name + "{") and 'run="live"' in line:
            tier = re.search(r'tier="(\w+)"', line).group(1)
            out[tier] = float(line.rsplit(" ", 1)[1])
    return out


def test_the_checkpoint_age_on_the_export_port_follows_each_save(cluster, driver):
    """The age a dashboard shows, time() less the exported commit time, is the truth within 1 s once Ray's
    export carries the commit; the age gauge itself lags by at most Ray's export interval more."""
    for step in (4, 5):
        committed_at = driver.ask(f"save {step}")["committed_at"]
        deadline = time.monotonic() + 30
        while True:
            stamps = scrape(cluster, "ray_rayckpt_last_commit_timestamp_seconds")
            if abs(stamps.get("storage", 0.0) - committed_at) < 0.01:
                break
            assert time.monotonic() < deadline, f"step {step}'s commit time never exported: {stamps}"
            time.sleep(0.1)
        ages = []
        for _ in range(3):  # the age moves on between saves
            scraped_at = time.time()
            stamp = scrape(cluster, "ray_rayckpt_last_commit_timestamp_seconds")["storage"]
            ages.append(scrape(cluster, "ray_rayckpt_checkpoint_age_seconds")["storage"])
            answered_at = time.time()
            truth = scraped_at - committed_at
            assert abs((scraped_at - stamp) - truth) < 1.0
            # set every second, exported every EXPORT_S: behind the truth by at most those (a loaded machine may
            # delay both; the lower bound is loose for that), and never ahead of the time its scrape answered
            # (the gauge may be set between the two scrapes, so the upper bound is taken after them)
            assert truth - (STALE_S + EXPORT_S) <= ages[-1] <= answered_at - committed_at + 0.05, (
                ages[-1],
                truth,
                answered_at - committed_at,
            )
            time.sleep(1.5)
        assert ages[-1] > ages[0], ages
