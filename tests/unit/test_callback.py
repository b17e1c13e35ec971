"""``RayckptCallback.after_exception`` in Ray Train's controller: it rolls saves back and never raises."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from rayckpt.train import callback


class _Remote:
    def __init__(self, fn) -> None:
        self.remote = fn


def run_context(name: str) -> SimpleNamespace:
    return SimpleNamespace(get_run_config=lambda: SimpleNamespace(name=name))


def test_an_unreachable_metadata_actor_is_a_warning_not_the_end_of_the_run(monkeypatch, caplog):
    """Its node lost with the workers', the actor is restarting: Ray Train must still restart the group."""

    def unreachable():
        raise RuntimeError("ActorUnavailableError: the actor's node died (injected)")

    monkeypatch.setattr(callback, "get_metadata_actor", unreachable)
    with caplog.at_level(logging.WARNING, logger=callback.__name__):
        callback.RayckptCallback().after_exception(run_context("lost"), {1: RuntimeError("worker died")})
    (record,) = caplog.records
    message = record.getMessage()
    assert "could not roll back the in-flight saves of run lost after rank 1: RuntimeError: worker died" in message
    assert "the actor's node died (injected)" in message and "commit timeout" in message


def test_the_failed_group_s_saves_are_rolled_back_and_named(monkeypatch, caplog):
    calls: list[tuple] = []
    actor = SimpleNamespace(
        fail_pending=_Remote(lambda run, reason: calls.append(("fail_pending", run, reason)) or [f"{run}-save"]),
        record_event=_Remote(lambda run, kind, data: calls.append(("record_event", run, kind, data))),
    )
    monkeypatch.setattr(callback, "get_metadata_actor", lambda: actor)
    waited: list = []
    monkeypatch.setattr(callback.ray, "get", lambda value, timeout=None: waited.append(timeout) or value)
    with caplog.at_level(logging.WARNING, logger=callback.__name__):
        callback.RayckptCallback().after_exception(run_context("r"), {0: ValueError("boom")})
    failed = ["r-save", "r@memory-save"]  # its storage saves, then its memory tier's
    assert calls == [
        ("fail_pending", "r", "worker group failed: rank 0: ValueError: boom"),
        ("fail_pending", "r@memory", "worker group failed: rank 0: ValueError: boom"),
        ("record_event", "r", "exception", {"failed_saves": failed, "reason": "rank 0: ValueError: boom"}),
    ]
    assert f"rolled back in-flight saves {failed} of run r" in caplog.records[0].getMessage()
    assert waited == [callback.ROLLBACK_TIMEOUT_S] * 2  # the controller's waits for the actor are bounded
