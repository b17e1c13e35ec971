"""The main job's training loop (rayckpt.examples.gpt_job.train) on plain gloo processes, no Ray."""

from __future__ import annotations

import shutil
from dataclasses import asdict

import pytest

from rayckpt.examples.gpt import GPTConfig
from rayckpt.testing.multiproc import run_ranks
from tests.helpers import workers

pytestmark = pytest.mark.slow


def config(steps: int, resume: bool) -> dict:
    model = {k: v for k, v in asdict(GPTConfig.tiny()).items() if k != "tie_head"}
    return {
        "model": model,
        "steps": steps,
        "checkpoint_every": 2,
        "global_batch": 12,
        "lr": 3e-3,
        "seed": 0,
        "resume": resume,
        "gpus": False,
    }


def test_resume_with_another_worker_count_continues_the_loss_curve(tmp_path):
    straight = run_ranks(workers.train_job_worker, 2, config(6, False), str(tmp_path / "a"))[0]
    assert [h["step"] for h in straight] == [1, 2, 3, 4, 5, 6]
    assert straight[-1]["loss"] < straight[0]["loss"]
    # Resume the step-4 checkpoint saved by 2 workers with 3 workers.
    shutil.copytree(tmp_path / "a" / "step_4", tmp_path / "b" / "step_4")
    resumed = run_ranks(workers.train_job_worker, 3, config(6, True), str(tmp_path / "b"))[0]
    assert [h["step"] for h in resumed] == [5, 6]
    for a, b in zip(straight[4:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
