"""End to end, the way a user runs it: `ray start --head` + `ray job submit -- python jobs/train.py`.

A worker SIGKILLed mid-run: Ray Train restarts the group, which restores, and the
job ends as an uninterrupted one. Requests that cannot run (a mistyped run to
resume, more CPUs than the cluster has) fail at once with one line. Four workers
saving and three resuming, with the job status from the dashboard's REST API and
the metrics on the export port, is `tests/s3/test_s3_job.py`: the same jobs, with
the checkpoints on S3.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from rayckpt.observe import alerts, dashboard
from tests.helpers.prometheus import HOW_TO_RUN, SCRAPE_INTERVAL_S, prometheus
from tests.helpers.promql import missing_from_export, substituted
from tests.helpers.ray_head import ROOT, TINY, error_line, get, ray_head, submit, submit_and_kill_a_worker, train_py

pytestmark = pytest.mark.slow


#: How often Ray's processes report their metrics to the export port (Ray's default is every 10 s; it floors this
#: at 1 s): the tests that read the export wait for the runs' last samples.
EXPORT_ENV = {"RAY_metrics_report_interval_ms": "1000"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node started with `ray start --head`, stopped by signalling its process group."""
    with ray_head(str(tmp_path_factory.mktemp("ray")), extra_env=EXPORT_ENV) as head:
        yield head


def test_requests_that_cannot_run_fail_at_once_with_one_line(cluster, tmp_path):
    storage = str(tmp_path / "ckpts")
    # A mistyped run to resume: refused before Ray is touched. More CPUs than the 8-CPU cluster (joined with
    # --address) has: refused before fit(). The two jobs run side by side.
    never_ran = ["--run-name", "never-ran", "--resume"]
    too_many = ["--address", cluster.address, "--num-workers", "12", "--cpus-per-worker", "1"]
    with ThreadPoolExecutor(2) as pool:
        mistyped = pool.submit(train_py, cluster, *never_ran, "--storage-path", storage, *TINY)
        needs_more = pool.submit(train_py, cluster, *too_many, "--storage-path", storage, *TINY)
        assert error_line(mistyped.result()).startswith("error: --resume: run 'never-ran' has no committed")
        needs = "error: --num-workers 12 x 1 CPUs per worker needs 12 CPUs, but the Ray cluster has 8"
        assert error_line(needs_more.result()).startswith(needs)
    assert not os.path.exists(os.path.join(storage, "gpt-demo")), "no run directory was made"


def dead_address() -> str:
    """A loopback address nothing listens at (a port bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_head_that_died_without_ray_stop_is_found_out_in_seconds_not_waited_for():
    tmp = tempfile.mkdtemp(prefix="rk-stale-", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        os.makedirs(os.path.join(tmp, "ray"))
        stale = os.path.join(tmp, "ray", "ray_current_cluster")
        address = dead_address()
        with open(stale, "w") as f:
            f.write(address)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=tmp, OMP_NUM_THREADS="1")

        def job(*flags: str) -> subprocess.CompletedProcess:
            storage = os.path.join(tmp, "ckpts")
            cmd = [sys.executable, "jobs/train.py", "--storage-path", storage, *flags, *TINY]
            return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)

        # --address auto: a running cluster or fail, so it fails, naming the address and the file.
        line = error_line(job("--address", "auto"))
        assert line.startswith(f"error: --address auto: the cluster last started on this machine ({address}, from")
        assert stale in line and "--address local" in line
        # The default: the stale file is skipped with one WARNING and a new local Ray starts (its 2 CPUs
        # are what the resource check then reports).
        proc = job("--num-workers", "12", "--cpus-per-worker", "1")
        warnings = [x for x in proc.stderr.splitlines() if "does not answer: it stopped without `ray stop`" in x]
        assert len(warnings) == 1 and address in warnings[0] and stale in warnings[0], proc.stderr[-4000:]
        assert error_line(proc).startswith("error: --num-workers 12 x 1 CPUs per worker needs 12 CPUs")
        # An address named outright that does not answer: refused, saying what to do.
        line = error_line(job("--address", address))
        assert line.startswith(f"error: the Ray cluster at {address} (from --address) does not answer within")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


#: The alert rules' checkpoint age in the real Prometheus: a run restarting after a kill passes it.
ALERT_AGE_S = 3.0


@pytest.fixture(scope="module", autouse=True)
def watching(cluster, tmp_path_factory):
    """A real Prometheus scraping the cluster through Ray's service-discovery file from before its first job;
    None where there is no ``prometheus`` (the test of the dashboard then skips, saying how to get it)."""
    if shutil.which("prometheus") is None:
        yield None
        return
    rules = alerts.rules_yaml(ALERT_AGE_S)
    with prometheus(cluster, str(tmp_path_factory.mktemp("prometheus")), rules=rules) as server:
        yield server


@dataclass(frozen=True)
class Runs:
    """The jobs of ``runs``: each job's summary, the killed job's output and the pid killed, when they ran."""

    plain: dict
    killed: dict
    resumed: dict
    logs: str
    pid: int
    began: float


@pytest.fixture(scope="module")
def runs(cluster, watching, tmp_path_factory):
    """Two runs of the main job side by side, one of them with a worker SIGKILLed mid-run (2 + 2 of the 8
    CPUs), the other then resumed with 3 workers: saves, a restart that restores, a resume that reshards."""
    storage = str(tmp_path_factory.mktemp("ckpts"))
    common = ["--checkpoint-every", "4", "--storage-path", storage, *TINY]
    flags = ["--num-workers", "2", "--steps", "16", *common]

    def plain_then_resumed() -> tuple[dict, dict]:  # the resume begins while the killed run may still go on
        plain, _ = submit(cluster, *flags, "--run-name", "plain")
        resumed, _ = submit(cluster, "--num-workers", "3", "--steps", "18", "--resume", "--run-name", "plain", *common)
        return plain, resumed

    began = time.time()
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(plain_then_resumed)
        # a worker is SIGKILLed 0.3 s after the step-4 checkpoint's manifest is in storage
        step_4 = os.path.join(storage, "killed", "rayckpt-step-00000004", "manifest.json")
        killed, logs, pid = submit_and_kill_a_worker(cluster, step_4, *flags, "--run-name", "killed", delay=0.3)
        plain, resumed = reference.result()
    return Runs(plain=plain, killed=killed, resumed=resumed, logs=logs, pid=pid, began=began)


def test_a_worker_killed_mid_run_restarts_and_the_job_ends_with_the_uninterrupted_loss(cluster, runs):
    plain, killed, logs, pid = runs.plain, runs.killed, runs.logs, runs.pid
    assert plain["restarts"] == 0 and plain["final_step"] == 16
    assert killed["restarts"] == 1 and killed["final_step"] == 16 and killed["num_workers"] == 2
    # The job's memory tier (--memory-every 1) saves every step, the storage steps (every 4th) to both
    # tiers: the restart restored the newest committed one, from memory unless it was a storage step
    # whose memory save had not committed (of one step, restore takes memory first).
    resumed = killed["resumed_from"]
    assert resumed is not None and 4 <= resumed < 16
    assert killed["restored_tier"] in ({"memory", "storage"} if resumed % 4 == 0 else {"memory"}), resumed
    restart = re.search(
        r"\(RayTrainWorker pid=(\d+)\).*restart 1: resumed from step (\d+) \(saved by 2\) "
        r"with 2 worker\(s\), from (memory|storage)",
        logs,
    )
    assert restart, logs[-6000:]
    # Rank 0's commit lines of the first group, told apart by their process, not by where they land in the
    # output: Ray forwards each worker's lines on its own, so a killed group's last lines may follow the next's.
    lines = re.findall(r"\(RayTrainWorker pid=(\d+)[^)]*\) rayckpt: killed (?:\(memory\) )?committed step (\d+)", logs)
    before = [int(step) for who, step in lines if who != restart.group(1)]
    assert before and resumed >= max(before), lines  # nothing the first group saw committed was lost
    assert int(restart.group(1)) != pid and int(restart.group(2)) == resumed
    assert killed["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-6)
    assert killed["last_checkpoint"].endswith("rayckpt-step-00000016")

    # What the Grafana dashboard queries, the run exported: every series of every panel, with each label the
    # panel matches on or groups by (Ray's export reaches the port every second: a bound, not a timing).
    queries = [expr for _, _, _, exprs in dashboard.panels([]) for expr in exprs]
    deadline = time.monotonic() + 90
    while missing := missing_from_export(queries, get(cluster.metrics), run="killed"):
        assert time.monotonic() < deadline, "\n".join(missing)
        time.sleep(1)
    # rayckpt status, against the cluster the job ran on: the run's newest checkpoint per tier and its restore.
    done = subprocess.run(
        [os.path.join(ROOT, ".venv", "bin", "rayckpt"), "status", "--address", cluster.address, "--json"],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (run,) = [r for r in json.loads(done.stdout)["runs"] if r["run"] == "killed"]
    assert run["tiers"]["storage"]["step"] == 16 and run["restarts"] == 1
    assert [(r["step"], r["tier"]) for r in run["restores"]] == [(resumed, killed["restored_tier"])]
    # The reference run, resumed by 3 workers from what 2 saved.
    assert runs.resumed["resumed_from"] == 16 and runs.resumed["num_workers"] == 3
    assert runs.resumed["final_step"] == 18

    # The Ray dashboard's Actors page: rayckpt's actors say what they are in its Repr column.
    from ray.util.state import list_actors

    alive = list_actors(address=cluster.dashboard, filters=[("state", "=", "ALIVE")], detail=True)
    reprs = {a.class_name: a.repr_name for a in alive if a.class_name in ("MetadataActor", "ShardWriter")}
    assert re.fullmatch(r"MetadataActor\(incarnation=[0-9a-f]{12}\)", reprs["MetadataActor"])
    assert re.fullmatch(r"ShardWriter\(node=[0-9a-f]{12}, memory_budget=[\d.]+GiB\)", reprs["ShardWriter"])


#: The panels that count events (restores, loads, stalls), by title: the runs' events they must show.
EVENT_PANELS = (
    "Save stall per rank (p50, p95)",
    "Restores by tier",
    "Restore time by tier (p50, p95)",
    "Restored bytes by tier",
    "Load time (p95)",
    "Bytes read and needed",
)


def panel_values(server, exprs: tuple[str, ...], start: float, end: float) -> list[tuple[dict, float]]:
    """Each series of each query over ``start``..``end`` with Grafana's variables at "All": (labels, its
    largest value), NaN values left out."""
    out = []
    for expr in exprs:
        for series in server.query_range(substituted(expr), start, end, step=SCRAPE_INTERVAL_S):
            values = [float(v) for _, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
            if values:
                out.append((series["metric"], max(values)))
    return out


def dashboard_gaps(server, runs: Runs) -> list[str]:
    """What the dashboard fails to show of ``runs``: a panel without data, an event panel at zero for a run."""
    start, end = runs.began - 10, time.time()
    gaps = []
    for _, title, _, exprs in dashboard.panels([]):
        values = panel_values(server, exprs, start, end)
        if not values:
            gaps.append(f"{title}: no data")
        if title in EVENT_PANELS:
            for run in ("plain", "killed"):
                if not any(labels.get("run") == run and v > 0 for labels, v in values):
                    gaps.append(f"{title}: nothing above 0 for run {run}: {values}")
    return gaps


def test_the_dashboard_shows_the_saves_restores_and_loads_that_happened(runs, watching):
    """Every panel of the Grafana dashboard, evaluated by a real Prometheus that scraped the cluster every 2 s
    while the jobs ran, has data; the restore, load and stall panels count the runs' events (a restore
    happens once, as a worker starts: the panels must count a series' first sample)."""
    if watching is None:
        pytest.skip(HOW_TO_RUN)
    (count,) = [exprs for _, title, _, exprs in dashboard.panels([]) if title == "Restores by tier"]
    deadline = time.monotonic() + 90  # Prometheus scrapes the export every 2 s: a bound, not a timing
    while True:
        gaps = dashboard_gaps(watching, runs)
        restores = {
            (labels["run"], labels["tier"]): round(v, 3)
            for labels, v in panel_values(watching, count, runs.began - 10, time.time())
        }
        # Each worker that restored counted once: the killed run's 2 after its restart, the resumed run's 3.
        wanted = {("killed", runs.killed["restored_tier"]): 2, ("plain", runs.resumed["restored_tier"]): 3}
        if not gaps and all(restores.get(k) == n for k, n in wanted.items()):
            break
        assert time.monotonic() < deadline, "\n".join([*gaps, f"restores {restores}, wanted {wanted}"])
        time.sleep(2)

    # The alert rules, loaded into the same Prometheus: a checkpoint older than ALERT_AGE_S while the run lived
    # (the killed run's restart) fired; once its rank 0 has ended, nothing fires for it.
    firing = f'ALERTS{{alertname="{alerts.TOO_OLD}", alertstate="firing", run="killed"}}'
    fired = watching.query_range(firing, runs.began, time.time(), step=SCRAPE_INTERVAL_S)
    assert fired and {s["metric"]["tier"] for s in fired} <= {"memory", "storage"}, fired
    assert watching.query_range('ray_rayckpt_run_active{run="killed"}', runs.began, time.time(), SCRAPE_INTERVAL_S)
    while watching.query('ray_rayckpt_run_active{run="killed"}') or watching.query(firing):
        assert time.monotonic() < deadline + 60, "run killed still active, or its alert firing, after it ended"
        time.sleep(2)


def test_a_submission_the_dashboard_took_is_followed_to_its_end(cluster):
    """What ``submit`` does when the dashboard dropped its request after taking the job: it follows the job's
    logs to the end and reads its final status (a loaded dashboard can close a request's connection)."""
    from tests.helpers.ray_head import BIN, ROOT, _follow, _job_known

    run = [f"{BIN}/ray", "job", "submit", "--address", cluster.dashboard, "--no-wait", "--submission-id"]
    for submission, code in (("followed-ok", 0), ("followed-bad", 3)):
        entry = f"import sys; print('hello from {submission}'); sys.exit({code})"
        taken = subprocess.run(
            [*run, submission, "--", "python", "-c", entry], cwd=ROOT, env=cluster.env, capture_output=True, text=True
        )
        assert taken.returncode == 0, taken.stderr[-2000:]
        assert _job_known(cluster, submission)
        followed = _follow(cluster, submission)
        assert f"hello from {submission}" in followed.stdout
        assert followed.returncode == (0 if code == 0 else 1), followed.stdout + followed.stderr
    assert not _job_known(cluster, "never-submitted")
