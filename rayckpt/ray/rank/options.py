"""How a save runs on Ray and where it goes: the records ``save_async`` builds from its keywords, once.

``engine.save.SaveOptions`` says how a save writes (block size, metadata, overwrite,
incremental, full_every); ``RayOptions`` how it runs on Ray; ``SaveDestination`` where
it goes and whose it is. The ``Checkpointer`` builds them once and passes them on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...engine.overlap import overlap_mode
from ..metadata.actor import DEFAULT_COMMIT_TIMEOUT_S
from .staging import staging_mode

#: The lane of ``save_async`` when none is named: one save in flight per process and lane.
DEFAULT_LANE = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class RayOptions:
    """How a save runs on Ray: ``save_async``'s options of these names (see there).

    Raises:
        ValueError: ``staging`` is none of the three, or ``overlap`` is not True, False or "all".
    """

    #: "shm", "object_store", "auto"; None: ``RAYCKPT_STAGING``, else "auto" (read at each save).
    staging: str | None = None
    #: True, False or "all" (a truthy or falsy value is taken as True or False).
    overlap: bool | str = True
    lane: str = DEFAULT_LANE
    commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S
    local_is_shared: bool | None = None

    def __post_init__(self) -> None:
        staging_mode(self.staging)
        object.__setattr__(self, "overlap", overlap_mode(self.overlap))


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveDestination:
    """Where a save goes and whose it is."""

    #: A local path, a URI ``pyarrow.fs`` understands, or a path on ``filesystem``.
    checkpoint_id: Any
    #: The run the save belongs to (its catalog, events and metrics).
    run: str = "default"
    #: The training step, kept in the manifest's user metadata.
    step: int | None = None
    #: A ``pyarrow.fs.FileSystem`` that ``checkpoint_id`` is a path on.
    filesystem: Any = None
