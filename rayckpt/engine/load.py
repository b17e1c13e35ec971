"""``load``: plan -> read -> finish, on every rank, with any world size.

Roles: every rank calls ``load`` (collective when a process group is
initialized). Each rank flattens its target state, gets its load plan (from the
manifest here, or from a ``PlanSource`` such as the MetadataActor on Ray),
reads and verifies only its byte ranges (``engine.reader``), and after one
all-gather that carries failures gives Stateful objects their filled dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs

from ..errors import RayckptError
from ..format.manifest import Blocks, manifest_values
from ..planning.load_plan import LoadPlan, TensorRequest, create_load_plan
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import read_manifest
from .coordinator import Coordinator, default_coordinator, gather_or_raise
from .reader import LoadInfo, read_into
from .state import FlatState, flatten


def load(
    state_dict: dict[str, Any],
    checkpoint_id: str | Any,
    *,
    strict: bool = True,
    process_group: Any = None,
    coordinator: Coordinator | None = None,
    filesystem: pafs.FileSystem | None = None,
    plan_source: PlanSource | None = None,
) -> LoadInfo:
    """Fill ``state_dict`` in place from the checkpoint at ``checkpoint_id``.

    Called by every rank, with any world size: each rank reads only the byte
    ranges its own shards need. Keys the target does not ask for are ignored; a
    key it asks for that the checkpoint lacks is an error unless ``strict=False``.
    Shape or dtype mismatches are errors (never a silent cast). Stateful objects
    get ``load_state_dict`` once every rank has read its data.
    """
    coord = coordinator or default_coordinator(process_group)
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    source = plan_source or plan_from_manifest
    flat_holder: list[FlatState] = []

    def read() -> LoadInfo:
        flat = flatten(state_dict)
        flat_holder.append(flat)
        plan, blocks, sizes, values = source(ckdir, flat, strict)
        return read_into(ckdir, plan, flat, blocks, sizes, values)

    info = gather_or_raise(coord, "load", read, RayckptError)[coord.rank]
    flat_holder[0].finish_load()
    return info


#: Gives a loading rank its read plan, the checksum blocks, file sizes and stored values.
PlanSource = Callable[[CheckpointDir, FlatState, bool], tuple[LoadPlan, Blocks, dict[str, int], dict[str, Any]]]


def plan_from_manifest(
    ckdir: CheckpointDir, flat: FlatState, strict: bool
) -> tuple[LoadPlan, Blocks, dict[str, int], dict[str, Any]]:
    """In-process planning: read the manifest and plan this rank's reads."""
    manifest = read_manifest(ckdir)
    plan = create_load_plan(manifest, tensor_requests(flat), flat.values.keys(), strict)
    sizes = {f.path: f.size for f in manifest.files}
    return plan, manifest.blocks, sizes, manifest_values(manifest, flat.values)


def tensor_requests(flat: FlatState) -> list[TensorRequest]:
    return [TensorRequest(t.key, t.dtype, t.shape, box) for t in flat.tensors.values() for box in t.boxes()]
