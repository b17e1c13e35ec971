"""The main job's training loop (rayckpt.examples.gpt_job.train) on plain gloo processes, no Ray."""

from __future__ import annotations

import shutil
from dataclasses import asdict

import pytest

from rayckpt.examples.gpt import GPTConfig
from rayckpt.examples.gpt_job import MIN_LR_RATIO, warmup_cosine
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import read_manifest
from rayckpt.testing.multiproc import run_ranks
from tests.helpers import workers

pytestmark = pytest.mark.slow
LR = 3e-3


def config(steps: int, resume: bool, schedule_steps: int | None = None) -> dict:
    model = {k: v for k, v in asdict(GPTConfig.tiny()).items() if k != "tie_head"}
    return {
        "model": model,
        "steps": steps,
        "schedule_steps": schedule_steps,
        "checkpoint_every": 2,
        "global_batch": 12,
        "lr": LR,
        "seed": 0,
        "resume": resume,
        "gpus": False,
    }


def test_resume_with_another_worker_count_and_more_steps_continues_the_loss_and_lr_curves(tmp_path):
    # resume=True on an empty directory (--resume-if-exists with nothing there) starts fresh.
    straight = run_ranks(workers.train_job_worker, 2, config(6, True), str(tmp_path / "a"))[0]
    assert [h["step"] for h in straight] == [1, 2, 3, 4, 5, 6]
    assert straight[-1]["loss"] < straight[0]["loss"]
    assert [h["lr"] for h in straight] == pytest.approx([LR * warmup_cosine(6)(s) for s in range(6)])
    hparams = read_manifest(CheckpointDir.resolve(str(tmp_path / "a" / "step_4"))).user_metadata["hparams"]
    assert hparams["schedule_steps"] == 6 and hparams["lr"] == LR and hparams["global_batch"] == 12

    # Resume the step-4 checkpoint saved by 2 workers with 3 workers and a longer run (--steps 8):
    # the LR schedule stays the run's (6 steps), so steps 5-6 equal the straight run's.
    shutil.copytree(tmp_path / "a" / "step_4", tmp_path / "b" / "step_4")
    resumed = run_ranks(workers.train_job_worker, 3, config(8, True), str(tmp_path / "b"))[0]
    assert [h["step"] for h in resumed] == [5, 6, 7, 8]
    for a, b in zip(straight[4:], resumed):
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
    assert [h["lr"] for h in resumed[2:]] == pytest.approx([LR * MIN_LR_RATIO] * 2), "past the horizon: the floor"

    # An explicit --schedule-steps replaces the stored horizon from the resumed step on.
    shutil.copytree(tmp_path / "a" / "step_4", tmp_path / "c" / "step_4")
    longer = run_ranks(workers.train_job_worker, 1, config(5, True, schedule_steps=10), str(tmp_path / "c"))[0]
    assert [h["step"] for h in longer] == [5]
    assert longer[0]["lr"] == pytest.approx(LR * warmup_cosine(10)(4))
    assert (
        read_manifest(CheckpointDir.resolve(str(tmp_path / "c" / "step_5"))).user_metadata["hparams"]["schedule_steps"]
        == 10
    )
