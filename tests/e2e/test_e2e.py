"""End to end, the way a user runs it: `ray start --head` + `ray job submit -- python jobs/train.py`.

Two runs of the job side by side: one on S3 (a local ``moto_server``), then
resumed with 3 workers from what its 2 saved; one on a local disk with a worker
SIGKILLed mid-run (Ray Train restarts the group, which restores, and the job
ends at the uninterrupted run's loss). The first S3 job names the endpoint in
the URI's query string, the resume names the same place as a plain
``s3://bucket/prefix`` with the endpoint in ``AWS_ENDPOINT_URL`` (the job's
runtime environment). The head starts with the session's dummy AWS variables,
so the jobs' drivers, Ray Train's controllers and their workers all have them.
The S3 run's catalog, Ray Train's retention (``num_to_keep=3``) and Ray Train's
own records all live on S3; nothing of it goes to a local disk. The jobs are
watched as a user watches them: their status from the dashboard's REST API,
rank 0's line per committed checkpoint in their logs, the checkpoint metrics on
the Prometheus export port, a real Prometheus and the Grafana dashboard's
queries. Requests that cannot run (a mistyped run to resume, more CPUs than the
cluster has, unusable S3 storage) fail at once with one line.
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
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow.fs as pafs
import pytest

from rayckpt.cli.commands import main as rayckpt_main
from rayckpt.examples.job_checks import JobConfigError, check_storage
from rayckpt.observe import alerts, dashboard
from rayckpt.storage.catalog import checkpoint_dir_name, latest_committed
from rayckpt.tools.listing import ls
from tests.helpers.prometheus import HOW_TO_RUN, SCRAPE_INTERVAL_S, prometheus
from tests.helpers.promql import missing_from_export, substituted
from tests.helpers.ray_head import (
    ROOT,
    TINY,
    error_line,
    free_port,
    get,
    ray_head,
    submit,
    submit_and_kill_a_worker,
    train_py,
)

pytestmark = pytest.mark.slow


#: How often Ray's processes report their metrics to the export port (Ray's default is every 10 s; it floors this
#: at 1 s): the tests that read the export wait for the runs' last samples.
EXPORT_ENV = {"RAY_metrics_report_interval_ms": "1000"}


@pytest.fixture(scope="module")
def cluster(s3_env, tmp_path_factory):
    """A head node started with `ray start --head` and the session's dummy AWS variables, stopped by signalling
    its process group."""
    with ray_head(str(tmp_path_factory.mktemp("ray")), extra_env={**s3_env, **EXPORT_ENV}) as head:
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


def test_unusable_s3_storage_fails_at_start_with_one_line(cluster, s3_server):
    missing = s3_server.uri("runs").replace(s3_server.bucket, "no-such-bucket", 1)
    line = error_line(train_py(cluster, "--storage-path", missing, *TINY))
    assert line == (
        f"error: --storage-path {missing}: bucket 'no-such-bucket' does not exist (or these credentials cannot see "
        "it): create it, or fix the bucket name"
    )
    with pytest.raises(JobConfigError, match=r"^--storage-path: cannot open .*Unexpected query parameter.*'endpoint'"):
        check_storage(f"s3://{s3_server.bucket}/runs?endpoint={s3_server.host_port}")
    down = f"s3://{s3_server.bucket}/runs?endpoint_override=127.0.0.1:{free_port()}&scheme=http"
    with pytest.raises(JobConfigError) as info:
        check_storage(down)
    assert str(info.value).startswith(f"--storage-path {down}: cannot reach bucket '{s3_server.bucket}': ")
    assert "\n" not in str(info.value)


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


#: What Ray Train writes into a run's directory besides the checkpoints it is told of.
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
RAY_TRAIN_RECORDS = {RAY_SNAPSHOT, ".validate_storage_marker"}


def local_roots(cluster) -> tuple[str, ...]:
    """Where a job on S3 would leave files on local disk by mistake: the cluster's temp dir (the jobs' working
    directories), the repository, Ray's default results directory."""
    return (cluster.temp_dir, ROOT, os.path.expanduser("~/ray_results"))


def local_storage_files(*roots: str) -> list[str]:
    """Checkpoints or Ray Train records under the local ``roots`` (a job on S3 should add none)."""
    found = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                if name.startswith("rayckpt-step-") or name in RAY_TRAIN_RECORDS or name.startswith("s3:"):
                    found.append(os.path.join(dirpath, name))
    return found


@dataclass(frozen=True)
class Runs:
    """The jobs of ``runs``: each job's summary and output, the pid killed, the S3 run's key prefix, the local
    checkpoint files there before the jobs, when they ran."""

    plain: dict
    killed: dict
    resumed: dict
    plain_logs: str
    logs: str
    resumed_logs: str
    pid: int
    prefix: str
    there_before: frozenset[str]
    began: float


@pytest.fixture(scope="module")
def runs(cluster, watching, s3_server, tmp_path_factory):
    """Two runs of the main job side by side (2 + 2 of the 8 CPUs): "plain" on S3, then resumed with 3 workers
    from what its 2 saved; "killed" on a local disk, with a worker SIGKILLed mid-run: saves, a restart that
    restores, a resume that reshards."""
    storage = str(tmp_path_factory.mktemp("ckpts"))
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    common = ["--checkpoint-every", "4", *TINY]
    flags = ["--num-workers", "2", "--steps", "16", *common]
    # What is there already (a run of the main job under ./checkpoints, say) is not these jobs' doing.
    there_before = frozenset(local_storage_files(*local_roots(cluster)))

    def plain_then_resumed() -> tuple[dict, str, dict, str]:  # the resume begins while the killed run may go on
        plain, plain_logs = submit(cluster, *flags, "--run-name", "plain", "--storage-path", s3_server.uri(prefix))
        # The same place, the endpoint from the job's environment (pyarrow's S3 reads AWS_ENDPOINT_URL); the
        # runtime environment reaches the job's driver, Ray Train's controller and the workers.
        bare = f"s3://{s3_server.bucket}/{prefix}"
        runtime_env = {"env_vars": {"AWS_ENDPOINT_URL": f"http://{s3_server.host_port}"}}
        resumed, resumed_logs = submit(
            cluster,
            *("--num-workers", "3", "--steps", "18", "--resume", "--run-name", "plain", "--storage-path", bare),
            *common,
            submit_flags=("--runtime-env-json", json.dumps(runtime_env)),
        )
        return plain, plain_logs, resumed, resumed_logs

    began = time.time()
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(plain_then_resumed)
        # a worker is SIGKILLed 0.3 s after the step-4 checkpoint's manifest is in storage
        step_4 = os.path.join(storage, "killed", "rayckpt-step-00000004", "manifest.json")
        local = [*flags, "--storage-path", storage, "--run-name", "killed"]
        killed, logs, pid = submit_and_kill_a_worker(cluster, step_4, *local, delay=0.3)
        plain, plain_logs, resumed, resumed_logs = reference.result()
    return Runs(
        plain=plain,
        killed=killed,
        resumed=resumed,
        plain_logs=plain_logs,
        logs=logs,
        resumed_logs=resumed_logs,
        pid=pid,
        prefix=prefix,
        there_before=there_before,
        began=began,
    )


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
    # Ray colours each line's prefix (unless RAY_COLOR_PREFIX=0).
    commit = r"\(RayTrainWorker pid=(\d+)[^)]*\)(?:\x1b\[[0-9;]*m)* rayckpt: killed (?:\(memory\) )?committed step"
    lines = re.findall(commit + r" (\d+)", logs)
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

    # The Ray dashboard's Actors page: rayckpt's actors say what they are in its Repr column.
    from ray.util.state import list_actors

    alive = list_actors(address=cluster.dashboard, filters=[("state", "=", "ALIVE")], detail=True)
    reprs = {a.class_name: a.repr_name for a in alive if a.class_name in ("MetadataActor", "ShardWriter")}
    assert re.fullmatch(r"MetadataActor\(incarnation=[0-9a-f]{12}\)", reprs["MetadataActor"])
    assert re.fullmatch(r"ShardWriter\(node=[0-9a-f]{12}, memory_budget=[\d.]+GiB\)", reprs["ShardWriter"])


def objects_under(s3_server, rel: str) -> list[str]:
    """Every object (no directory marker) at any depth under ``rel``, relative to it."""
    fs, base = s3_server.filesystem(), s3_server.fs_path(rel)
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    return sorted(i.path[len(base) + 1 :] for i in infos if i.type == pafs.FileType.File)


def read_json(s3_server, rel: str):
    with s3_server.filesystem().open_input_stream(s3_server.fs_path(rel)) as f:
        return json.loads(f.read())


def test_the_run_on_s3_saves_with_2_workers_and_resumes_with_3(cluster, runs, s3_server, capsys):
    run, prefix, first, second = "plain", runs.prefix, runs.plain, runs.resumed
    uri = s3_server.uri(prefix)
    assert first["final_step"] == 16 and first["num_workers"] == 2 and first["resumed_from"] is None
    assert first["last_checkpoint"] == s3_server.fs_path(f"{prefix}/{run}/{checkpoint_dir_name(16)}")
    for step in (4, 8, 12, 16):  # the job's logs have rank 0's line per committed checkpoint
        line = rf"rayckpt: {run} committed step {step} \(\d+\.\d MiB, \d+\.\d\d s\)"
        assert re.search(line, runs.plain_logs), runs.plain_logs[-4000:]
    # The resume (the endpoint from its runtime environment), by 3 workers from what 2 saved.
    assert second["resumed_from"] == 16 and second["num_workers"] == 3 and second["final_step"] == 18
    assert "on 3 rank(s), resumed from step 16" in runs.resumed_logs, runs.resumed_logs[-4000:]
    assert second["final_loss"] < first["final_loss"] * 1.5  # training continued, it did not restart

    # The catalog on S3 (the CLI): exactly the 3 checkpoints Ray Train keeps, the newest (the resume's last
    # step) by 3 workers.
    capsys.readouterr()
    assert rayckpt_main(["ls", uri, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(e["run"], e["step"], e["status"], e["world_size"]) for e in listed] == [
        (run, 12, "committed", 2),
        (run, 16, "committed", 2),
        (run, 18, "committed", 3),
    ]
    assert latest_committed(ls(uri, run=run)).step == 18
    manifest = read_json(s3_server, f"{prefix}/{run}/{checkpoint_dir_name(18)}/manifest.json")
    assert manifest["user_metadata"]["hparams"]["schedule_steps"] == 16, "the first launch's LR schedule kept"

    # Retention deleted steps 4 and 8 whole; every object left belongs to a kept checkpoint, is a file of the
    # shared store of incremental saves that a kept checkpoint names (or that the next collection removes:
    # retention deletes a directory after the commit that collected), or is Ray's record.
    kept = {checkpoint_dir_name(step) for step in (12, 16, 18)}
    left = objects_under(s3_server, f"{prefix}/{run}")
    assert {name.split("/")[0] for name in left} == kept | RAY_TRAIN_RECORDS | {".rayckpt-shared"}, left
    named = set()
    for name in kept:
        m = read_json(s3_server, f"{prefix}/{run}/{name}/manifest.json")
        named |= {f["path"].split("/")[-1] for f in m["files"] if f["path"].startswith("../.rayckpt-shared/")}
        assert rayckpt_main(["verify", s3_server.uri(f"{prefix}/{run}/{name}")]) == 0, name
    assert named <= {name.split("/")[-1] for name in left if name.startswith(".rayckpt-shared/")}
    for step in (4, 8):
        assert not s3_server.exists(f"{prefix}/{run}/{checkpoint_dir_name(step)}"), step
    for name in kept:
        assert "manifest.json" in s3_server.listing(f"{prefix}/{run}/{name}"), name

    # Ray Train's own record of the run, on S3: the kept checkpoints, the newest as its latest.
    snapshot = read_json(s3_server, f"{prefix}/{run}/{RAY_SNAPSHOT}")
    assert {r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]} == kept
    assert snapshot["latest_checkpoint_result"]["checkpoint_dir_name"] == checkpoint_dir_name(18)

    # Nothing of the jobs on S3 on local disk (the killed run's checkpoints are in a directory of their own).
    assert set(local_storage_files(*local_roots(cluster))) - runs.there_before == set()

    # As a user watches them: the three jobs SUCCEEDED in the dashboard's REST API, the S3 run's checkpoint
    # metrics on the export port.
    jobs = json.loads(get(f"{cluster.dashboard}/api/jobs/"))
    submitted = [j for j in jobs if j.get("type") == "SUBMISSION" and "jobs/train.py" in j.get("entrypoint", "")]
    statuses = sorted((re.search(r"--run-name (\S+)", j["entrypoint"]).group(1), j["status"]) for j in submitted)
    assert statuses == [("killed", "SUCCEEDED"), (run, "SUCCEEDED"), (run, "SUCCEEDED")], statuses
    wanted = {
        "ray_rayckpt_checkpoints_committed_total",
        "ray_rayckpt_save_stall_seconds_count",
        "ray_rayckpt_write_throughput_bytes_per_second",  # a gauge: set again between saves
    }
    deadline = time.time() + 60
    while True:
        export = get(cluster.metrics).splitlines()
        names = {x.split("{")[0] for x in export if x.startswith("ray_rayckpt_") and f'run="{run}"' in x}
        if wanted <= names:
            break
        assert time.time() < deadline, f"rayckpt metrics of run {run} missing from the export port; have {names}"
        time.sleep(0.5)


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
