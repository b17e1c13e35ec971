"""`jobs/train.py` submitted with `ray job submit` to a Ray head started as a user does (``ray_head``, from
``testbed.ray_head``: its own ``--temp-dir`` and ports, stopped by its own pid)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

from testbed.host_jobs import TINY  # noqa: F401 - the tests' tiny GPT flags
from testbed.ray_head import BIN, RayHead, free_port, free_ports, get, ray_head  # noqa: F401 - the tests' names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def submit(head: RayHead, *args: str, submit_flags: tuple[str, ...] = ()) -> tuple[dict, str]:
    """Run ``jobs/train.py`` through ``ray job submit``; return its JSON summary and the job's output.

    ``submit_flags`` go to ``ray job submit`` itself (``--runtime-env-json``, say).
    """
    submission = f"train-{uuid.uuid4().hex[:8]}"
    cmd = [f"{BIN}/ray", "job", "submit", "--address", head.dashboard, "--submission-id", submission]
    cmd += ["--working-dir", ".", *submit_flags, "--", "python", "jobs/train.py", *args]
    deadline = time.time() + 300  # generous: a loaded 2-core machine starts the agent slowly
    while True:
        proc = subprocess.run(cmd, cwd=ROOT, env=head.env, capture_output=True, text=True, timeout=400)
        # The head's job agent comes up a little after the dashboard does.
        retry = "No available agent to submit job" in proc.stderr
        if proc.returncode != 0 and DROPPED in proc.stderr:
            # A loaded dashboard may drop the connection of the submit request, having taken the job or not.
            if _job_id(head, submission) is not None or _job_known(head, submission):
                proc = _follow(head, submission)
            else:
                retry = True
        if not retry or time.time() > deadline:
            break
        time.sleep(1)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Reporting training result" not in proc.stdout + proc.stderr, "Ray Train's per-rank report lines"
    summaries = [doc for doc in map(_json_object, proc.stdout.splitlines()) if doc is not None and "final_step" in doc]
    assert summaries, proc.stdout[-4000:]
    return summaries[-1], proc.stdout + proc.stderr


def submit_and_kill_a_worker(head: RayHead, committed: str, *args: str, delay: float = 0.0) -> tuple[dict, str, int]:
    """``submit`` that SIGKILLs one of its job's Train workers ``delay`` seconds after the file ``committed``
    (a glob) exists.

    The worker's pid comes from Ray's state API (what ``ray list actors`` shows, filtered to this job: another
    job may run beside it) and the commit from polling storage: both are seen at once, where the job's forwarded
    log lines arrive seconds late (a kill timed by them can land after the last step, and then nothing
    restarts). Returns the summary, the output and the pid killed.
    """
    submission = f"kill-{uuid.uuid4().hex[:8]}"
    cmd = [f"{BIN}/ray", "job", "submit", "--address", head.dashboard, "--submission-id", submission, "--working-dir"]
    proc = subprocess.Popen(
        [*cmd, ".", "--", "python", "jobs/train.py", *args],
        cwd=ROOT,
        env=head.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(proc.stdout or ()), daemon=True)
    reader.start()
    job_id: str | None = None
    pids: list[int] = []
    killed = 0
    while not killed and proc.poll() is None:
        job_id = job_id or _job_id(head, submission)
        pids = pids or (_train_worker_pids(head, job_id) if job_id else [])
        if pids and glob.glob(committed):
            time.sleep(delay)
            killed = pids[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    proc.wait(timeout=400)
    reader.join(timeout=30)
    output = "".join(seen)
    assert proc.returncode == 0, output[-6000:]
    assert killed, f"the job ended before {committed} existed: {output[-4000:]}"
    summaries = [doc for doc in map(_json_object, output.splitlines()) if doc is not None and "final_step" in doc]
    assert summaries, output[-4000:]
    return summaries[-1], output, killed


#: What ``ray job submit`` prints when the dashboard closed the connection of its request.
DROPPED = "Remote end closed connection without response"


def _job_known(head: RayHead, submission: str) -> bool:
    """Whether the dashboard has the submission ``submission`` (its driver may not have started yet)."""
    try:
        get(f"{head.dashboard}/api/jobs/{submission}")
    except OSError:
        return False
    return True


def _follow(head: RayHead, submission: str) -> subprocess.CompletedProcess:
    """What ``ray job submit`` would have printed for a submission the dashboard took: the job's logs, followed
    to its end, and its final status (the return code is 0 only if it succeeded)."""
    logs = subprocess.run(
        [f"{BIN}/ray", "job", "logs", submission, "--address", head.dashboard, "--follow"],
        cwd=ROOT,
        env=head.env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    status = json.loads(get(f"{head.dashboard}/api/jobs/{submission}")).get("status")
    ok = logs.returncode == 0 and status == "SUCCEEDED"
    return subprocess.CompletedProcess(logs.args, 0 if ok else 1, logs.stdout, f"{logs.stderr}job status: {status}\n")


def _job_id(head: RayHead, submission: str) -> str | None:
    """The Ray job id of the submission ``submission`` (None until it is known, its driver started)."""
    try:
        return json.loads(get(f"{head.dashboard}/api/jobs/{submission}")).get("job_id")
    except OSError:  # not registered yet
        return None


def _train_worker_pids(head: RayHead, job_id: str) -> list[int]:
    """The pids of the live Ray Train workers of the job ``job_id`` (none yet: an empty list)."""
    from ray.util.state import list_actors

    filters = [("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE"), ("job_id", "=", job_id)]
    return sorted(actor.pid for actor in list_actors(address=head.dashboard, filters=filters, detail=True))


def _json_object(line: str) -> dict | None:
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def train_py(head: RayHead, *args: str) -> subprocess.CompletedProcess:
    """Run ``jobs/train.py`` directly (not submitted) in the head's environment."""
    return subprocess.run(
        [sys.executable, "jobs/train.py", *args],
        cwd=ROOT,
        env=dict(head.env, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one ``error: `` line of a job refused at start (exit status 2)."""
    assert proc.returncode == 2, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-4000:]
    return errors[0]
