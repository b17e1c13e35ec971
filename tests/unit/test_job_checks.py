"""The training job's up-front checks: the run to resume, the cluster's resources, every flag, ``--help``."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

import rayckpt
from rayckpt.examples.gpt_job import main, parse_args, quiet_ray_train_logs, run
from rayckpt.examples.job_checks import (
    JobConfigError,
    check_resources,
    check_resume,
    check_shared_storage,
    describe_runs,
)
from rayckpt.examples.job_flags import build_parser


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    """Runs: 'gpt' with two committed checkpoints, 'crashed' with only a save that never committed."""
    root = tmp_path_factory.mktemp("job") / "ckpts"
    for step in (10, 20):
        path = root / "gpt" / f"rayckpt-step-{step:08d}"
        rayckpt.save({"w": torch.ones(4)}, str(path), metadata={"step": step, "run": "gpt"})
    crashed = root / "crashed" / "rayckpt-step-00000005"
    crashed.mkdir(parents=True)
    (crashed / "rank0.arrow").write_bytes(b"partial")
    return str(root)


def test_describe_runs_says_what_each_run_holds(storage, tmp_path):
    assert describe_runs(storage) == "'crashed' (no committed checkpoint), 'gpt' (2 committed, latest step 20)"
    assert describe_runs(str(tmp_path / "nothing-here")) == "none"


def test_resume_of_a_run_with_nothing_to_resume_fails_naming_the_runs_there(storage):
    for run_name in ("gtp", "crashed"):
        with pytest.raises(JobConfigError) as err:
            check_resume(storage, run_name, resume=True, resume_if_exists=False)
        message = str(err.value)
        assert "\n" not in message
        assert f"--resume: run {run_name!r} has no committed checkpoint under {storage}" in message
        assert "'gpt' (2 committed, latest step 20)" in message and "'crashed' (no committed checkpoint)" in message
        assert "--resume-if-exists" in message


def test_resume_if_exists_and_fresh_runs(storage):
    assert check_resume(storage, "gpt", resume=True, resume_if_exists=False) is True
    # --resume-if-exists restores when there is something (the loop starts fresh when restore finds nothing).
    assert check_resume(storage, "new-run", resume=False, resume_if_exists=True) is True
    assert check_resume(storage, "gpt", resume=False, resume_if_exists=True) is True
    assert check_resume(storage, "new-run", resume=False, resume_if_exists=False) is False
    with pytest.raises(JobConfigError, match=r"run 'gpt' already exists at .*gpt: pass --resume"):
        check_resume(storage, "gpt", resume=False, resume_if_exists=False)


def test_main_refuses_a_mistyped_resume_before_starting_ray(storage, monkeypatch, capsys):
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "init", no_ray)
    assert main(["--storage-path", storage, "--run-name", "never-ran", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume: run 'never-ran' has no committed checkpoint") and "\n" not in err


def test_main_with_gpus_and_no_gpu_fails_at_start_with_one_error_line(storage, monkeypatch, capsys):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})  # a CPU-only machine, as here
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeManagerAddress": "127.0.0.1", "Alive": True}])
    assert main(["--storage-path", storage, "--run-name", "gpu-run", "--gpus", "--num-workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --gpus: no CUDA device is visible") and "\n" not in err


def request(*argv: str) -> argparse.Namespace:
    return parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, cluster, fragments",
    [
        (
            ["--num-workers", "4", "--cpus-per-worker", "1"],
            {"CPU": 2.0},
            ["--num-workers 4 x 1 CPUs per worker needs 4 CPUs, but the Ray cluster has 2", "--cpus-per-worker"],
        ),
        (
            ["--num-workers", "2", "--global-batch", "12", "--gpus"],
            {"CPU": 16.0, "GPU": 1.0},
            ["--gpus with --num-workers 2 needs 2 GPUs, but the Ray cluster has 1", "drop --gpus"],
        ),
        (["--num-workers", "2"], {}, ["needs 2 CPUs, but the Ray cluster has 0", "--skip-resource-check"]),
        (
            ["--num-workers", "2", "--gpus", "--cpus-per-worker", "4"],
            {"CPU": 16.0},
            ["--gpus: no CUDA device is visible: the Ray cluster has 0 GPUs", "drop --gpus"],
        ),
    ],
)
def test_requests_the_cluster_cannot_hold_are_refused(argv, cluster, fragments):
    with pytest.raises(JobConfigError) as err:
        check_resources(request(*argv), cluster)
    assert "\n" not in str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_an_elastic_run_needs_room_for_its_minimum_only():
    args = request("--num-workers", "2-4", "--cpus-per-worker", "1")
    assert check_resources(args, {"CPU": 2.0}) == {"CPU": 1.0}
    with pytest.raises(JobConfigError) as err:
        check_resources(request("--num-workers", "3-4", "--cpus-per-worker", "1"), {"CPU": 2.0})
    assert "--num-workers 3 x 1 CPUs per worker needs 3 CPUs, but the Ray cluster has 2" in str(err.value)


def test_requests_the_cluster_holds_pass():
    assert check_resources(request("--num-workers", "4"), {"CPU": 2.0}) == {"CPU": 0.5}  # shared CPUs
    assert check_resources(request("--num-workers", "4"), {"CPU": 4.0}) is None
    assert check_resources(request("--num-workers", "2", "--cpus-per-worker", "2"), {"CPU": 4.0}) == {"CPU": 2.0}
    assert check_resources(request("--num-workers", "4", "--gpus"), {"CPU": 1.0, "GPU": 4.0}) is None


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--num-workers", "0"], "--num-workers must be at least 1, got 0"),
        (["--steps", "-3"], "--steps must be at least 1, got -3"),
        (["--schedule-steps", "0"], "--schedule-steps must be at least 1"),
        (["--d-model", "0"], "--d-model must be at least 1"),
        (["--lr", "0"], "--lr must be positive, got 0.0"),
        (["--cpus-per-worker", "-1"], "--cpus-per-worker must be positive"),
        (["--num-workers", "5"], "--global-batch 12 is not divisible by --num-workers 5"),
        (["--d-model", "100", "--n-heads", "3"], "--n-heads 3 does not divide --d-model 100"),
        (["--resume", "--resume-if-exists"], "not allowed with argument"),
        (["--num-workers", "4-2"], "--num-workers 4-2: MIN is larger than MAX"),
        (["--num-workers", "0-4"], "--num-workers must be at least 1, got 0-4"),
        (["--num-workers", "two"], "expected a count N or a range MIN-MAX, got 'two'"),
        (["--num-workers", "2-5"], "not divisible by 5 workers, which the elastic --num-workers 2-5 may run with"),
        (["--num-workers", "5-6", "--global-batch", "25"], "not divisible by 6 workers"),
        (["--max-failures", "-2"], "--max-failures must be -1 (no limit) or at least 0, got -2"),
        (["--keep", "0"], "error: --keep must be at least 1, got 0"),
        (["--keep", "-2"], "error: --keep must be at least 1, got -2"),
        (["--vocab-size", "64"], "--data corpus reads bytes (ids 0-255): --vocab-size must be at least 256, got 64"),
        (["--epoch-samples", "-1"], "--epoch-samples must be 0 (every window) or more, got -1"),
        (["--data", "web"], "invalid choice: 'web'"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_help_shows_every_flag_with_help_and_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for fragment in ("grows back at Ray Train's resize (default: 4)", "(default: 20)", "(default: ./checkpoints)"):
        assert fragment in out
    assert "(default: None)" not in out  # those flags say in their help what leaving them out means
    assert "default: RAY_ADDRESS" in out and "(default: --steps of the run's first launch" in out


def test_keep_is_the_number_of_checkpoints_ray_train_keeps(storage, monkeypatch):
    import ray
    import ray.train.torch

    from rayckpt.examples.gpt_job import run

    assert parse_args([]).keep == 3
    asked = {}

    class Trainer:  # records what the job asks Ray Train for, and stops there
        def __init__(self, *args, run_config, **kwargs):
            asked["num_to_keep"] = run_config.checkpoint_config.num_to_keep
            raise KeyboardInterrupt

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeManagerAddress": "127.0.0.1", "Alive": True}])
    monkeypatch.setattr(ray.train.torch, "TorchTrainer", Trainer)
    with pytest.raises(KeyboardInterrupt):
        run(parse_args(["--storage-path", storage, "--run-name", "kept", "--keep", "5"]))
    assert asked == {"num_to_keep": 5}


@pytest.mark.parametrize(
    ("address", "joined"), [(None, "local"), ("10.0.0.7:6379", "10.0.0.7:6379"), ("local", "local")]
)
def test_address_goes_to_ray_init_once_it_answers(address, joined, tmp_path, monkeypatch):
    import ray

    from rayckpt.ray import joining

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise Stop

    asked = []
    monkeypatch.setattr(joining, "answers", lambda addr, timeout_s=0: asked.append(addr) or True)  # no traffic
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no cluster was started here
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    argv = ["--storage-path", str(tmp_path)] + (["--address", address] if address else [])
    with pytest.raises(Stop):
        run(parse_args(argv))
    assert seen == {"address": joined}
    assert asked == ([address] if address not in (None, "local") else [])


def test_ray_trains_per_rank_report_lines_are_silenced():
    from ray.train.v2._internal.execution import context

    context.logger.setLevel(logging.NOTSET)
    quiet_ray_train_logs()
    assert not context.logger.isEnabledFor(logging.INFO)
    assert context.logger.isEnabledFor(logging.WARNING)


def test_a_local_storage_path_is_refused_on_nodes_of_several_machines():
    nodes = ["10.1.0.2", "10.1.0.3", "10.1.0.2"]
    with pytest.raises(JobConfigError) as exc:
        check_shared_storage("/data/ckpts", nodes, local_is_shared=False)
    assert str(exc.value) == (
        "--storage-path /data/ckpts is a local path, but the Ray cluster's nodes run on 2 machines "
        "(10.1.0.2, 10.1.0.3) and every node must reach the same files: use s3://... or gs://..., "
        "or an NFS path mounted on every node with RAYCKPT_LOCAL_IS_SHARED=1"
    )
    with pytest.raises(JobConfigError, match="file:///data/ckpts is a local path"):
        check_shared_storage("file:///data/ckpts", nodes, local_is_shared=False)
    check_shared_storage("/data/ckpts", nodes, local_is_shared=True)  # NFS, said so
    check_shared_storage("s3://bucket/ckpts", nodes, local_is_shared=False)
    check_shared_storage("/data/ckpts", ["10.1.0.2", "10.1.0.2"], local_is_shared=False)  # nodes of one machine
