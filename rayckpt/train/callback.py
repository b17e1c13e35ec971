"""``RayckptCallback``: the controller side of the TorchTrainer integration.

Runs in Ray Train's controller: records each reported checkpoint and, when the
worker group fails, fails the run's in-flight saves at once (their partial files
removed) instead of after the commit timeout, with a WARNING line naming them
(Ray forwards it to the driver's output).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
import ray.train

from ..ray.metadata.actor import get_metadata_actor
from .tiers import memory_run

logger = logging.getLogger(__name__)

#: How long the controller waits for the MetadataActor to roll a failed group's saves back.
ROLLBACK_TIMEOUT_S = 30.0


class RayckptCallback(ray.train.UserCallback):
    """Controller-side callback: records reported checkpoints and rolls back saves of a failed run.

    Add it to ``RunConfig(callbacks=[RayckptCallback()])`` (a ``ray.train.UserCallback``);
    it takes no arguments. Ray Train's controller calls it:

    1. ``after_report``, for each checkpoint a worker reported: a ``reported`` event
       with the MetadataActor.
    2. ``after_exception``, when the worker group failed: the MetadataActor fails the
       run's in-flight saves (to storage and to the memory tier, ``fail_pending``),
       removing their partial files at once instead of after the commit timeout, and
       the controller logs a WARNING naming them
       (``rayckpt: rolled back in-flight saves [...] of run <run> after <why>``).
    """

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        """Record a ``reported`` event (step, path) for a reported checkpoint (Ray Train's controller)."""
        if checkpoint is not None:
            run = run_context.get_run_config().name
            step = metrics[0].get("step") if metrics else None
            # Rank 0 of the workers prints the commit line (with its size and time); this is Ray Train's side.
            logger.debug("rayckpt: run %s reported step %s at %s to Ray Train", run, step, checkpoint.path)
            get_metadata_actor().record_event.remote(run, "reported", {"step": step, "path": checkpoint.path})

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        """Fail the run's in-flight saves at once (Ray Train's controller, after a worker group failed).

        Never raises: an exception here would end the run in Ray Train's controller
        instead of letting it restart the workers (the MetadataActor may be restarting
        itself, its node lost with the workers'); the saves then fail at their commit
        timeout, with a WARNING saying so.
        """
        run = run_context.get_run_config().name
        reason = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(worker_exceptions.items()))
        try:
            meta = get_metadata_actor()
            failed: list[str] = []
            for name in (run, memory_run(run)):  # its storage saves, then its memory saves
                failed += ray.get(
                    meta.fail_pending.remote(name, f"worker group failed: {reason}"), timeout=ROLLBACK_TIMEOUT_S
                )
            meta.record_event.remote(run, "exception", {"failed_saves": failed, "reason": reason})
        except Exception as exc:  # noqa: BLE001 - whatever the actor's state, Ray Train must go on to restart
            logger.warning(
                "rayckpt: could not roll back the in-flight saves of run %s after %s (%s: %s); they fail at "
                "their commit timeout instead",
                run,
                reason,
                type(exc).__name__,
                exc,
            )
            return
        if failed:
            logger.warning("rayckpt: rolled back in-flight saves %s of run %s after %s", failed, run, reason)
