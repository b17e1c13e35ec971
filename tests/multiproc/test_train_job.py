"""The main job's training loop (rayckpt.examples.gpt_job.train) on plain gloo processes, no Ray."""

from __future__ import annotations

import shutil
from dataclasses import asdict

import pytest

from rayckpt.data import DataPosition
from rayckpt.examples.corpus import BYTE_VOCAB
from rayckpt.examples.gpt import GPTConfig
from rayckpt.examples.gpt_job import MIN_LR_RATIO, warmup_cosine
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.storage.commit import read_manifest
from rayckpt.testing.multiproc import run_ranks
from tests.helpers import workers
from tests.helpers.sample_log import check_exactly_once, read_steps

pytestmark = pytest.mark.slow
LR = 3e-3


#: Samples per epoch of the corpus: 3 steps of the global batch of 12.
EPOCH = 36


def config(steps: int, resume: bool, schedule_steps: int | None = None, log=None, every: int = 2) -> dict:
    model = {k: v for k, v in asdict(GPTConfig.tiny()).items() if k != "tie_head"}
    model["vocab_size"] = BYTE_VOCAB
    return {
        "model": model,
        "steps": steps,
        "schedule_steps": schedule_steps,
        "checkpoint_every": every,
        "global_batch": 12,
        "lr": LR,
        "seed": 0,
        "resume": resume,
        "gpus": False,
        "data": "corpus",
        "epoch_samples": EPOCH,
        "sample_log": str(log) if log else None,
    }


def test_resume_with_another_worker_count_and_more_steps_continues_the_loss_and_lr_curves(tmp_path):
    # resume=True on an empty directory (--resume-if-exists with nothing there) starts fresh.
    straight = run_ranks(workers.train_job_worker, 2, config(6, True, log=tmp_path / "log-a"), str(tmp_path / "a"))[0]
    assert [h["step"] for h in straight] == [1, 2, 3, 4, 5, 6]
    assert straight[-1]["loss"] < straight[0]["loss"]
    assert [h["lr"] for h in straight] == pytest.approx([LR * warmup_cosine(6)(s) for s in range(6)])
    hparams = read_manifest(CheckpointDir.resolve(str(tmp_path / "a" / "step_4"))).user_metadata["hparams"]
    assert hparams["schedule_steps"] == 6 and hparams["lr"] == LR and hparams["global_batch"] == 12

    # Resume the step-4 checkpoint saved by 2 workers with 3 workers and a longer run (--steps 8):
    # the LR schedule stays the run's (6 steps), so steps 5-6 equal the straight run's.
    shutil.copytree(tmp_path / "a" / "step_4", tmp_path / "b" / "step_4")
    resumed = run_ranks(workers.train_job_worker, 3, config(8, True, log=tmp_path / "log-b"), str(tmp_path / "b"))[0]
    assert [h["step"] for h in resumed] == [5, 6, 7, 8]
    for a, b in zip(straight[4:], resumed):
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
    assert [h["lr"] for h in resumed[2:]] == pytest.approx([LR * MIN_LR_RATIO] * 2), "past the horizon: the floor"
    # Each step's global batch is the same samples whatever the worker count: steps 5-6 as the straight run's
    a, b = read_steps(tmp_path / "log-a"), read_steps(tmp_path / "log-b")
    assert [a[n].epoch for n in range(1, 7)] == [0, 0, 0, 1, 1, 1]
    check_exactly_once(a, EPOCH)
    for n in (5, 6):
        assert b[n].world_size == 3 and sorted(b[n].all_ids()) == sorted(a[n].all_ids())
    assert b[7].epoch == 2

    # Resumed with the same worker count, every rank gets the straight run's samples, in its order.
    shutil.copytree(tmp_path / "a" / "step_4", tmp_path / "d" / "step_4")
    run_ranks(workers.train_job_worker, 2, config(6, True, log=tmp_path / "log-d"), str(tmp_path / "d"))
    d = read_steps(tmp_path / "log-d")
    assert sorted(d) == [5, 6] and all(d[n].ids == a[n].ids for n in (5, 6))

    # An explicit --schedule-steps replaces the stored horizon from the resumed step on.
    shutil.copytree(tmp_path / "a" / "step_4", tmp_path / "c" / "step_4")
    longer = run_ranks(workers.train_job_worker, 1, config(5, True, schedule_steps=10), str(tmp_path / "c"))[0]
    assert [h["step"] for h in longer] == [5]
    assert longer[0]["lr"] == pytest.approx(LR * warmup_cosine(10)(4))
    assert (
        read_manifest(CheckpointDir.resolve(str(tmp_path / "c" / "step_5"))).user_metadata["hparams"]["schedule_steps"]
        == 10
    )


def test_4_3_2_4_workers_crossing_epochs_consume_every_sample_once_per_epoch(tmp_path):
    root, log = str(tmp_path / "run"), tmp_path / "log"
    # each leg saves at its last step only; the next resumes it with another worker count
    for world, steps in ((4, 2), (3, 5), (2, 7), (4, 11)):
        history = run_ranks(workers.train_job_worker, world, config(steps, True, log=log, every=100), root)[0]
        assert history[-1]["step"] == steps
    steps = read_steps(log)
    assert [steps[n].world_size for n in (1, 3, 6, 8)] == [4, 3, 2, 4]
    position = DataPosition.from_json(read_manifest(CheckpointDir.resolve(root + "/step_11")).data_position, "m")
    per_epoch = check_exactly_once(steps, EPOCH, position)
    assert sorted(per_epoch) == [0, 1, 2, 3] and position.consumed == 24 and position.world_size == 4


def test_a_global_batch_the_worker_count_does_not_divide_is_refused_before_any_step(tmp_path):
    results = run_ranks(
        workers.train_job_worker, 5, config(4, True, log=tmp_path / "log"), str(tmp_path / "run"), allow_failures=True
    )
    assert all("global batch 12 is not divisible by 5 workers" in str(r.error) for r in results)
    assert not (tmp_path / "log").exists() and not (tmp_path / "run").exists()
