"""End to end, the way a user runs it: `ray start --head` + `ray job submit -- python jobs/train.py`.

Four workers train and checkpoint; a second job resumes with three. The job
status comes back SUCCEEDED from the dashboard's REST API and the checkpoint
metrics are on the Prometheus export port. Requests that cannot run (a mistyped
run to resume, more CPUs than the cluster has) fail at once with one line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16", "--vocab-size", "64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node started with `ray start --head --block`, stopped by signalling its process group."""
    ports = {"gcs": free_port(), "dashboard": free_port(), "metrics": free_port()}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", PATH=f"{BIN}:{env.get('PATH', '')}")
    temp = tmp_path_factory.mktemp("ray")
    head = subprocess.Popen(
        [
            f"{BIN}/ray",
            "start",
            "--head",
            "--block",
            "--port",
            str(ports["gcs"]),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(ports["dashboard"]),
            "--metrics-export-port",
            str(ports["metrics"]),
            "--num-cpus",
            "8",
            "--temp-dir",
            str(temp),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    dashboard = f"http://127.0.0.1:{ports['dashboard']}"
    deadline = time.time() + 120
    while True:
        try:
            get(f"{dashboard}/api/jobs/")
            break
        except OSError:
            if time.time() > deadline or head.poll() is not None:
                os.killpg(head.pid, signal.SIGKILL)
                pytest.fail("ray start --head did not bring up the dashboard")
            time.sleep(1)
    yield {
        "env": env,
        "dashboard": dashboard,
        "metrics": f"http://127.0.0.1:{ports['metrics']}/metrics",
        "address": f"127.0.0.1:{ports['gcs']}",
    }
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)


def submit(cluster, *args: str) -> tuple[dict, str]:
    """Run ``jobs/train.py`` through ``ray job submit``; return its JSON summary and the job's output."""
    cmd = [
        f"{BIN}/ray",
        "job",
        "submit",
        "--address",
        cluster["dashboard"],
        "--working-dir",
        ".",
        "--",
        "python",
        "jobs/train.py",
        *args,
    ]
    deadline = time.time() + 300  # generous: a loaded 2-core machine starts the agent slowly
    while True:
        proc = subprocess.run(cmd, cwd=ROOT, env=cluster["env"], capture_output=True, text=True, timeout=400)
        # The head's job agent comes up a little after the dashboard does.
        if "No available agent to submit job" not in proc.stderr or time.time() > deadline:
            break
        time.sleep(3)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Reporting training result" not in proc.stdout + proc.stderr, "Ray Train's per-rank report lines"
    summaries = []
    for line in proc.stdout.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "final_step" in doc:
            summaries.append(doc)
    assert summaries, proc.stdout[-4000:]
    return summaries[-1], proc.stdout + proc.stderr


def test_submit_train_then_resume_with_fewer_workers(cluster, tmp_path):
    storage = str(tmp_path / "ckpts")
    common = ["--storage-path", storage, "--run-name", "e2e", "--checkpoint-every", "2", *TINY]
    first, logs = submit(cluster, "--num-workers", "4", "--steps", "4", *common)
    assert first["final_step"] == 4 and first["num_workers"] == 4 and first["resumed_from"] is None
    assert first["last_checkpoint"].endswith("rayckpt-step-00000004")
    assert os.path.exists(os.path.join(first["last_checkpoint"], "manifest.json"))
    for step in (2, 4):  # the job's logs have rank 0's line per committed checkpoint
        assert re.search(rf"rayckpt: e2e committed step {step} \(\d+\.\d MiB, \d+\.\d\d s\)", logs), logs[-4000:]

    second, _ = submit(cluster, "--num-workers", "3", "--steps", "6", "--resume", *common)
    assert second["resumed_from"] == 4 and second["num_workers"] == 3 and second["final_step"] == 6
    assert second["last_checkpoint"].endswith("rayckpt-step-00000006")
    assert second["final_loss"] < first["final_loss"] * 1.5  # training continued, it did not restart
    with open(os.path.join(second["last_checkpoint"], "manifest.json")) as f:
        hparams = json.load(f)["user_metadata"]["hparams"]
    assert hparams["schedule_steps"] == 4, "the resumed run keeps the first launch's LR schedule"

    jobs = json.loads(get(f"{cluster['dashboard']}/api/jobs/"))
    statuses = [j["status"] for j in jobs if "jobs/train.py" in j.get("entrypoint", "")]
    assert statuses == ["SUCCEEDED", "SUCCEEDED"]

    deadline = time.time() + 60
    while True:
        text = get(cluster["metrics"])
        names = {line.split("{")[0] for line in text.splitlines() if line.startswith("ray_rayckpt_")}
        wanted = {
            "ray_rayckpt_checkpoints_committed_total",
            "ray_rayckpt_save_stall_seconds_count",
            "ray_rayckpt_write_throughput_bytes_per_second",  # a gauge: set again between saves
        }
        if wanted <= names:
            break
        assert time.time() < deadline, f"rayckpt metrics missing from the export port; have {sorted(names)}"
        time.sleep(3)


def train_py(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "jobs/train.py", *args],
        cwd=ROOT,
        env=dict(cluster["env"], OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-4000:]
    return errors[0]


def test_requests_that_cannot_run_fail_at_once_with_one_line(cluster, tmp_path):
    storage = str(tmp_path / "ckpts")
    # A mistyped run to resume: refused before Ray is touched.
    proc = train_py(cluster, "--storage-path", storage, "--run-name", "never-ran", "--resume", *TINY)
    assert error_line(proc).startswith("error: --resume: run 'never-ran' has no committed")
    # More CPUs than the 8-CPU cluster (joined with --address) has: refused before fit().
    proc = train_py(
        cluster,
        "--address",
        cluster["address"],
        "--storage-path",
        storage,
        "--num-workers",
        "12",
        "--cpus-per-worker",
        "1",
        *TINY,
    )
    needs = "error: --num-workers 12 x 1 CPUs per worker needs 12 CPUs, but the Ray cluster has 8"
    assert error_line(proc).startswith(needs)
    assert not os.path.exists(os.path.join(storage, "gpt-demo")), "no run directory was made"
