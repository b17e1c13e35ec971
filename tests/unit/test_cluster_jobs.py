"""``tests.helpers.cluster_jobs``: a cluster job run to its end, or started early and taken by its fixture."""

from __future__ import annotations

import pytest

from tests.helpers import cluster_jobs
from tests.helpers.cluster_jobs import ClusterJob, early, run_cluster_job, start_early, stop_early

JOB = "tests.helpers.sleep_job"


def test_a_job_runs_to_its_end_without_ray_address_and_with_its_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    result = run_cluster_job(JOB, tmp_path, "0", "0", timeout=60, env={"X": "y"})
    assert result == {"seconds": 0.0, "ray_address": None, "extra": "y", "out": tmp_path}


def test_a_job_started_early_is_taken_once_by_name(tmp_path):
    start_early("t", JOB, tmp_path, "0.2", "0")
    job = early("t")
    assert isinstance(job, ClusterJob) and early("t") is None
    assert job.result(timeout=60)["seconds"] == 0.2


def test_a_failing_job_names_its_exit_code_and_output(tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)sleep_job exited with 3: sleeping 0.0 s.*failing on purpose"):
        run_cluster_job(JOB, tmp_path, "0", "3", timeout=60)


def test_a_job_past_its_timeout_is_killed_and_named(tmp_path):
    job = ClusterJob(JOB, tmp_path, "60", "0")
    with pytest.raises(AssertionError, match=r"sleep_job still running after 0.5 s"):
        job.result(timeout=0.5)
    assert job.proc.returncode is not None


def test_a_job_no_fixture_took_is_stopped_at_the_session_end(tmp_path):
    start_early("left", JOB, tmp_path, "60", "0")
    proc = cluster_jobs.EARLY["left"].proc
    stop_early()
    assert cluster_jobs.EARLY == {} and proc.returncode is not None and early("left") is None
