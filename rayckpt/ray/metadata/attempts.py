"""How many worker groups of a training run have started: what ``Checkpointer.restarts`` says.

Ray-free; the MetadataActor holds one ``AttemptCounter``. A Ray Train run (one
``TorchTrainer.fit()``, its run id) starts a worker group, and another after each
failure Ray Train recovers from and each elastic resize.

From a run's second group on, the MetadataActor fails the run's saves still in
flight when the group starts (files removed, lease released): they are an earlier
group's, which is gone, as ``RayckptCallback`` does after a failure. Ray Train's
elastic resize stops a healthy group without any callback, and such a save would
otherwise hold its location until its commit timeout, refusing the new group's
save of the same step.
"""

from __future__ import annotations

from ...bounded import BoundedMap


class AttemptCounter:
    """Worker groups started per training run, for the ``kept`` most recently active runs."""

    def __init__(self, kept: int) -> None:
        #: Training run (its attempt key) -> worker groups started, least recently active first.
        self.counts: BoundedMap[str, int] = BoundedMap(kept)

    def begin(self, key: str) -> int:
        """Count a group of run ``key``; return how many started before it (0: the first)."""
        before = self.counts.pop(key, 0)
        self.counts.put(key, before + 1)
        return before
