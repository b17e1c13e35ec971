"""The MetadataActor installs rayckpt's Grafana dashboard next to Ray's own, on a real local Ray with its
dashboard, and again (one file still) when Ray restarts the actor.

The Ray runs in a driver process of its own (``tests/helpers/dashboard_job.py``, its own ``--temp-dir``
under ``tmp_path``): this module's one Ray, apart from the test session's (which runs without Ray's dashboard).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from rayckpt.observe import dashboard

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """What the driver saw, and the session directory it left (Ray stopped)."""
    temp_dir = str(tmp_path_factory.mktemp("ray-dash"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray's workers (the MetadataActor) import this checkout's rayckpt.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.update(RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1")
    for name in ("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", "RAY_METRICS_OUTPUT_ROOT", dashboard.GLOBAL_FILTERS_ENV):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "helpers", "dashboard_job.py"), "--temp-dir", temp_dir],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    seen = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert seen, proc.stdout[-3000:] + proc.stderr[-5000:]
    return seen[-1]


def test_the_actor_installs_the_dashboard_next_to_ray_s(installed):
    folder = installed["folder"]
    assert folder == os.path.join(installed["session"], "metrics", "grafana", "dashboards")
    assert installed["ray_default"], "Ray's metrics head wrote no default_grafana_dashboard.json"
    first, _ = installed["listing"]
    assert "default_grafana_dashboard.json" in first and "rayckpt_grafana_dashboard.json" in first, first
    assert installed["installs"][0] is not None
    with open(installed["path"]) as f:
        board = json.load(f)
    assert board["uid"] == "rayckpt" and board == dashboard.dashboard([])


def test_a_restarted_actor_installs_it_again_as_the_one_file(installed):
    first_incarnation, second_incarnation = installed["incarnations"]
    assert second_incarnation is not None and second_incarnation != first_incarnation, "the actor did not restart"
    first, second = installed["installs"]
    assert second is not None and second != first, "the restarted actor did not install the dashboard again"
    listing = installed["listing"][1]
    assert [n for n in listing if "rayckpt" in n] == ["rayckpt_grafana_dashboard.json"], listing
    assert not [n for n in listing if n.endswith(".tmp")], listing


def test_each_install_is_one_info_line_in_the_actor_s_log(installed):
    lines = []
    for path in glob.glob(os.path.join(installed["session"], "logs", "worker-*")):
        with open(path, errors="replace") as f:
            lines += [line for line in f if "Grafana dashboard" in line]
    assert len([line for line in lines if "installed at " + installed["path"] in line]) == 2, lines
    assert not [line for line in lines if "not installed" in line], lines
