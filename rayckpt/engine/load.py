"""``load``: plan -> read -> finish, on every rank, with any world size.

Roles: every rank calls ``load`` (collective when a process group is
initialized). Each rank flattens its target state, gets its load plan (from a
``PlanSource`` such as the MetadataActor on Ray, else ``planned_at_root``: rank 0
plans every FSDP2 rank at once and scatters each its slice, or each rank plans
from the manifest), reads and verifies only its byte ranges (``engine.reader``),
and after one all-gather that carries failures gives Stateful objects their
filled dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs

from ..errors import RayckptError
from ..format.manifest import Blocks, manifest_values
from ..planning.load_plan import LoadPlan, TensorRequest, create_load_plan
from ..planning.rank_slice import LoadAsk, RankSlice, asked_alike, create_rank_slices, specs_of
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import read_manifest
from .coordinator import Coordinator, default_coordinator, gather_or_raise, plan_at_root
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
    flat_holder: list[FlatState] = []

    def flat() -> FlatState:
        """The target, flattened once: for this rank's ask, or in ``read``."""
        if not flat_holder:
            flat_holder.append(flatten(state_dict))
        return flat_holder[0]

    source = plan_source or planned_at_root(coord, ckdir, flat, strict)

    def read() -> LoadInfo:
        plan, blocks, sizes, values = source(ckdir, flat(), strict)
        return read_into(ckdir, plan, flat(), blocks, sizes, values)

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


def planned_at_root(
    coord: Coordinator, ckdir: CheckpointDir, flat: Callable[[], FlatState], strict: bool
) -> PlanSource:
    """The default ``PlanSource``; collective (every rank calls it, before any rank reads).

    Each rank sends rank 0 a ``LoadAsk`` (a digest of its specs, values and
    ``strict``, and whether its shards are FSDP2's dim-0 ones). When all ask
    alike, rank 0 alone reads the manifest, plans every rank at once
    (``create_rank_slices``) and each rank receives only its slice, from which it
    builds its plan. Otherwise (other layouts, ranks asking differently, chunks
    that are not dim-0 slabs) each rank plans from the manifest itself
    (``plan_from_manifest``). An error of the manifest or of the asks (a corrupt
    manifest, a missing key, a shape or dtype mismatch) is raised on every rank
    when it reads, as when each rank planned for itself.
    """

    def ask() -> LoadAsk:
        f = flat()
        return LoadAsk.of(tensor_requests(f), f.values.keys(), strict, coord.rank, coord.world_size)

    def plan(asks: list[LoadAsk]) -> list[RankSlice | RayckptError | None]:
        if not asked_alike(asks):
            return [None] * len(asks)
        try:
            manifest = read_manifest(ckdir)
            f = flat()
            found = create_rank_slices(manifest, specs_of(tensor_requests(f)), len(asks), f.values.keys(), strict)
        except RayckptError as exc:
            return [exc] * len(asks)
        return [None] * len(asks) if found is None else list(found)

    part = plan_at_root(coord, "load", ask, plan, RayckptError)

    def source(ckdir: CheckpointDir, flat: FlatState, strict: bool) -> tuple[LoadPlan, Blocks, dict, dict]:
        if part is None:
            return plan_from_manifest(ckdir, flat, strict)
        if isinstance(part, RayckptError):
            raise part
        return part.plan(specs_of(tensor_requests(flat))), part.blocks, part.file_sizes, part.values

    return source


def tensor_requests(flat: FlatState) -> list[TensorRequest]:
    return [TensorRequest(t.key, t.dtype, t.shape, box) for t in flat.tensors.values() for box in t.boxes()]
