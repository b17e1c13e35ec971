"""``load`` on Ray: ``rayckpt.load`` with each rank's load plan served by the MetadataActor.

Every rank calls it. The actor keeps the manifest and the plans cached (for
FSDP2 layouts the first rank to ask gets every rank's plan computed at once), so
ranks do not each decode the manifest; the reads are the engine's own.
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow.fs as pafs
import ray

from ...engine.coordinator import Coordinator, default_coordinator
from ...engine.load import LoadInfo, tensor_requests
from ...engine.load import load as _engine_load
from ...engine.reader import RankRead
from ...storage.checkpoint_dir import CheckpointDir
from .. import metrics
from ..metadata.actor import get_metadata_actor
from ..metadata.plan_cache import ReadAsk
from ..records import run_and_tier
from .save_handle import actor_location


def load(
    state_dict: dict[str, Any],
    checkpoint_id: str | Any,
    *,
    strict: bool = True,
    run: str = "",
    filesystem: pafs.FileSystem | None = None,
    process_group: Any = None,
    coordinator: Coordinator | None = None,
) -> LoadInfo:
    """``rayckpt.load`` with the load plan computed (and cached per checkpoint and request) by the MetadataActor.

    Every rank calls it (collective when a process group is initialized); each reads
    only its byte ranges. When the ranks hold FSDP2's dim-0 shards, the first rank to
    ask (``MetadataActor.read_plan``) gets the plans of every rank computed at once by
    the bulk planner and the others their part of that cached result.

    Args:
        state_dict: The target, filled in place (as for ``rayckpt.load``).
        checkpoint_id: A local path, a URI ``pyarrow.fs`` understands, or a path on ``filesystem``.
        strict: Whether a key the target asks for and the checkpoint lacks is an error.
        run: The run the load's metrics are counted for.
        filesystem: A ``pyarrow.fs.FileSystem`` that ``checkpoint_id`` is a path on.
        process_group: The ``torch.distributed`` group to load across (default: the default group).
        coordinator: How the ranks agree, in place of ``process_group``.

    Returns:
        This rank's ``LoadInfo``.

    Raises:
        CheckpointNotFoundError: No committed checkpoint at ``checkpoint_id``.
        IncompatibleStateError: The target does not fit the checkpoint (a missing key
            with ``strict=True``, a shape or dtype that differs).
        CorruptCheckpointError: A damaged manifest or shard file (as for ``rayckpt.load``).
    """
    start = time.perf_counter()
    coord = coordinator or default_coordinator(process_group)
    meta = get_metadata_actor()
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    location = actor_location(ckdir, filesystem)

    def plan_source(ckdir, flat, strict):  # noqa: ANN001 - engine.PlanSource
        bundle = ray.get(
            meta.read_plan.remote(
                location,
                filesystem,
                ReadAsk(
                    requests=tuple(tensor_requests(flat)),
                    value_keys=tuple(flat.values),
                    strict=strict,
                    rank=coord.rank,
                    world_size=coord.world_size,
                ),
                run,
            )
        )
        return RankRead(plan=bundle.plan, blocks=bundle.blocks, file_sizes=bundle.file_sizes, values=bundle.values)

    info = _engine_load(
        state_dict, checkpoint_id, strict=strict, coordinator=coord, filesystem=filesystem, plan_source=plan_source
    )
    name = run_and_tier(run)[0]  # a memory checkpoint's run is tracked as <run>@memory: its metrics are the run's
    metrics.send("rayckpt_load_seconds", time.perf_counter() - start, run=name, rank=coord.rank)
    metrics.send("rayckpt_bytes_read", info.bytes_read, run=name, rank=coord.rank)
    metrics.send("rayckpt_bytes_needed", info.bytes_needed, run=name, rank=coord.rank)
    metrics.send("rayckpt_bytes_fetched", info.bytes_fetched, run=name, rank=coord.rank)
    metrics.send("rayckpt_read_requests", info.requests, run=name, rank=coord.rank)
    return info
