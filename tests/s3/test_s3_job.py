"""The training job on S3, as a user runs it: `ray start --head`, `ray job submit -- python jobs/train.py
--storage-path s3://...`; four workers save, three resume. The jobs are watched as a user watches them:
their status from the dashboard's REST API, rank 0's line per committed checkpoint in their logs, the
checkpoint metrics on the Prometheus export port.

The first job names the endpoint in the URI's query string, the resume names
the same place as a plain ``s3://bucket/prefix`` with the endpoint in
``AWS_ENDPOINT_URL`` (the job's runtime environment). The head starts with the
session's dummy AWS variables, so the job's driver, Ray Train's controller and
its workers all have them. The run's catalog, Ray Train's retention
(``num_to_keep=3``) and Ray Train's own records all live on S3; nothing goes to
a local disk.
"""

from __future__ import annotations

import json
import os
import re
import time

import pyarrow.fs as pafs
import pytest

from rayckpt.cli.commands import main as rayckpt_main
from rayckpt.examples.job_checks import JobConfigError, check_storage
from rayckpt.storage.catalog import checkpoint_dir_name, latest_committed
from rayckpt.tools.listing import ls
from tests.helpers.ray_head import ROOT, TINY, error_line, free_port, get, ray_head, submit, train_py

pytestmark = pytest.mark.slow

#: What Ray Train writes into a run's directory besides the checkpoints it is told of.
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
RAY_TRAIN_RECORDS = {RAY_SNAPSHOT, ".validate_storage_marker"}


@pytest.fixture(scope="module")
def cluster(s3_env, tmp_path_factory):
    # Ray's processes report their metrics to the export port every second (default 10 s): the test waits for them.
    env = {**s3_env, "RAY_metrics_report_interval_ms": "1000"}
    with ray_head(str(tmp_path_factory.mktemp("ray")), extra_env=env) as head:
        yield head


def objects_under(s3_server, rel: str) -> list[str]:
    """Every object (no directory marker) at any depth under ``rel``, relative to it."""
    fs, base = s3_server.filesystem(), s3_server.fs_path(rel)
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    return sorted(i.path[len(base) + 1 :] for i in infos if i.type == pafs.FileType.File)


def read_json(s3_server, rel: str):
    with s3_server.filesystem().open_input_stream(s3_server.fs_path(rel)) as f:
        return json.loads(f.read())


def local_storage_files(*roots: str) -> list[str]:
    """Checkpoints or Ray Train records under the local ``roots`` (an S3 job should add none)."""
    found = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                if name.startswith("rayckpt-step-") or name in RAY_TRAIN_RECORDS or name.startswith("s3:"):
                    found.append(os.path.join(dirpath, name))
    return found


def test_job_saves_with_4_workers_and_resumes_with_3_on_s3(cluster, s3_server, s3_prefix, capsys):
    run = "s3job"
    uri = s3_server.uri(s3_prefix)
    # What is there already (a run of the main job under ./checkpoints, say) is not this test's doing.
    local_roots = (cluster.temp_dir, ROOT, os.path.expanduser("~/ray_results"))
    there_before = set(local_storage_files(*local_roots))
    common = ["--run-name", run, "--checkpoint-every", "2", *TINY]
    first, logs = submit(cluster, "--num-workers", "4", "--steps", "8", "--storage-path", uri, *common)
    assert first["final_step"] == 8 and first["num_workers"] == 4 and first["resumed_from"] is None
    assert first["last_checkpoint"] == s3_server.fs_path(f"{s3_prefix}/{run}/{checkpoint_dir_name(8)}")
    for step in (2, 4, 6, 8):  # the job's logs have rank 0's line per committed checkpoint
        assert re.search(rf"rayckpt: {run} committed step {step} \(\d+\.\d MiB, \d+\.\d\d s\)", logs), logs[-4000:]

    # The same place, the endpoint from the job's environment (pyarrow's S3 reads AWS_ENDPOINT_URL); the
    # runtime environment reaches the job's driver, Ray Train's controller and the workers.
    plain = f"s3://{s3_server.bucket}/{s3_prefix}"
    runtime_env = {"env_vars": {"AWS_ENDPOINT_URL": f"http://{s3_server.host_port}"}}
    second, logs = submit(
        cluster,
        *("--num-workers", "3", "--steps", "10", "--resume", "--storage-path", plain, *common),
        submit_flags=("--runtime-env-json", json.dumps(runtime_env)),
    )
    assert second["resumed_from"] == 8 and second["num_workers"] == 3 and second["final_step"] == 10
    assert "on 3 rank(s), resumed from step 8" in logs, logs[-4000:]
    assert second["final_loss"] < first["final_loss"] * 1.5  # training continued, it did not restart

    # The catalog on S3 (the CLI): exactly the 3 checkpoints Ray Train keeps, the newest by 3 workers.
    capsys.readouterr()
    assert rayckpt_main(["ls", uri, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(e["run"], e["step"], e["status"], e["world_size"]) for e in listed] == [
        (run, 6, "committed", 4),
        (run, 8, "committed", 4),
        (run, 10, "committed", 3),
    ]
    assert latest_committed(ls(uri, run=run)).step == 10
    manifest = read_json(s3_server, f"{s3_prefix}/{run}/{checkpoint_dir_name(10)}/manifest.json")
    assert manifest["user_metadata"]["hparams"]["schedule_steps"] == 8, "the first launch's LR schedule kept"

    # Retention deleted steps 2 and 4 whole; every object left belongs to a kept checkpoint, is a file of the
    # shared store of incremental saves that a kept checkpoint names (or that the next collection removes:
    # retention deletes a directory after the commit that collected), or is Ray's record.
    kept = {checkpoint_dir_name(step) for step in (6, 8, 10)}
    left = objects_under(s3_server, f"{s3_prefix}/{run}")
    assert {name.split("/")[0] for name in left} == kept | RAY_TRAIN_RECORDS | {".rayckpt-shared"}, left
    named = set()
    for name in kept:
        m = read_json(s3_server, f"{s3_prefix}/{run}/{name}/manifest.json")
        named |= {f["path"].split("/")[-1] for f in m["files"] if f["path"].startswith("../.rayckpt-shared/")}
        assert rayckpt_main(["verify", s3_server.uri(f"{s3_prefix}/{run}/{name}")]) == 0, name
    assert named <= {name.split("/")[-1] for name in left if name.startswith(".rayckpt-shared/")}
    for step in (2, 4):
        assert not s3_server.exists(f"{s3_prefix}/{run}/{checkpoint_dir_name(step)}"), step
    for name in kept:
        assert "manifest.json" in s3_server.listing(f"{s3_prefix}/{run}/{name}"), name

    # Ray Train's own record of the run, on S3: the kept checkpoints, the newest as its latest.
    snapshot = read_json(s3_server, f"{s3_prefix}/{run}/{RAY_SNAPSHOT}")
    assert {r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]} == kept
    assert snapshot["latest_checkpoint_result"]["checkpoint_dir_name"] == checkpoint_dir_name(10)

    assert set(local_storage_files(*local_roots)) - there_before == set()  # nothing of these jobs on local disk

    # As a user watches them: both jobs SUCCEEDED in the dashboard's REST API, the metrics on the export port.
    jobs = json.loads(get(f"{cluster.dashboard}/api/jobs/"))
    assert [j["status"] for j in jobs if "jobs/train.py" in j.get("entrypoint", "")] == ["SUCCEEDED", "SUCCEEDED"]
    wanted = {
        "ray_rayckpt_checkpoints_committed_total",
        "ray_rayckpt_save_stall_seconds_count",
        "ray_rayckpt_write_throughput_bytes_per_second",  # a gauge: set again between saves
    }
    deadline = time.time() + 60
    while True:
        names = {line.split("{")[0] for line in get(cluster.metrics).splitlines() if line.startswith("ray_rayckpt_")}
        if wanted <= names:
            break
        assert time.time() < deadline, f"rayckpt metrics missing from the export port; have {sorted(names)}"
        time.sleep(0.5)


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
