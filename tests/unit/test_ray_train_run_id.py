"""The one private Ray API rayckpt reads: Ray Train's run id, which ``Checkpointer`` counts restarts by.

Ray Train offers no public way to tell one ``TorchTrainer.fit()`` from another across its
restarts; its internal train context has the run id. This test fails when Ray moves it, so
that the fallback (the job id and run name) is never taken silently.
"""

from __future__ import annotations

import dataclasses

from rayckpt.train import run_id


def test_ray_train_keeps_its_run_id_where_the_checkpointer_reads_it():
    from ray.train.v2._internal.execution.context import TrainContext, TrainRunContext, get_train_context

    assert callable(get_train_context)
    assert TrainContext.__annotations__["train_run_context"] in (TrainRunContext, "TrainRunContext")
    assert "run_id" in {f.name for f in dataclasses.fields(TrainRunContext)}


def test_outside_a_train_run_the_key_is_the_job_and_the_run_name(monkeypatch):
    class Context:
        def get_job_id(self) -> str:
            return "job-7"

    monkeypatch.setattr(run_id.ray, "get_runtime_context", lambda: Context())
    assert run_id.attempt_key("toy") == "job-7/toy"
