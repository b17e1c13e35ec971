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
from dataclasses import replace
from typing import Any

import pyarrow.fs as pafs

from ..data.loaders import resume
from ..errors import RayckptError
from ..format.manifest import manifest_values
from ..phases import log_phases, phase, timed
from ..planning.load_plan import TensorRequest, create_load_plan
from ..planning.rank_slice import LoadAsk, RankSlice, asked_alike, create_rank_slices, specs_of
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import read_manifest
from .coordinator import Coordinator, default_coordinator, gather_or_raise, plan_at_root
from .reader import LoadInfo, RankRead, read_into
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
    data: Any = None,
) -> LoadInfo:
    """Fill ``state_dict`` in place from the checkpoint at ``checkpoint_id``, with any world size.

    Collective when a process group is initialized (every rank calls it, whatever
    the world size that saved); works in a single process without one. Each rank
    reads only the byte ranges its shards need, verifying every block's checksum.

    Call order (the planning and the reads each end in a collective that carries
    failures, so an error on any rank is raised on every rank and no rank is left
    waiting):

    1. Each rank flattens ``state_dict`` (calling Stateful objects' ``state_dict()``
       in sorted key order) and sends rank 0 a digest of what it asks for.
    2. When every rank asks alike (FSDP2's dim-0 shards), rank 0 reads the
       manifest, plans every rank's reads at once and sends each rank its slice;
       otherwise each rank plans from the manifest itself. ``plan_source``
       replaces this step (the MetadataActor plans on Ray).
    3. Each rank reads its byte ranges into its targets, verifying every block.
    4. Once every rank has read, each calls its Stateful objects'
       ``load_state_dict()`` with their filled dicts.

    What is checked, and what ``LoadInfo`` counts: ``docs/guarantees.md``, "Load
    semantics".

    Args:
        state_dict: The target, keys matched by their flattened name: tensors,
            DTensors and Stateful objects to fill, plain values to replace.
        checkpoint_id: A local path, a URI ``pyarrow.fs`` understands (``file://``,
            ``s3://``, ``gs://``, ``hdfs://``), or a path on ``filesystem``.
        strict: Whether a key the target asks for and the checkpoint lacks is an
            error. False: such targets are left as they were and listed in
            ``LoadInfo.missing_keys``. Checkpoint keys the target does not ask for
            are ignored either way.
        process_group: The ``torch.distributed`` process group to load across;
            None: the default group when one is initialized, else this process alone.
        coordinator: How the ranks agree, in place of ``process_group``; None: from
            ``process_group``.
        filesystem: A ``pyarrow.fs.FileSystem`` that ``checkpoint_id`` is a path on.
        plan_source: Gives each rank its read plan in place of step 2 (the Ray
            layer passes the MetadataActor's); None: rank 0 plans.
        data: A ``rayckpt.data.ResumableSampler`` (or the loader around it) to continue from
            the checkpoint's data position, this rank's share of the rest of the epoch
            (docs/data.md); a checkpoint without one restarts the epoch, with one WARNING.

    Returns:
        This rank's ``LoadInfo``: bytes needed, read and fetched, reads, the keys
            skipped, and ``phases``, where its seconds went.

    Raises:
        CheckpointNotFoundError: No committed checkpoint (no manifest) at
            ``checkpoint_id``.
        IncompatibleStateError: A key the target asks for is missing (with
            ``strict=True``), or a global shape or dtype differs; the message names
            the key and both sides. A dtype is never cast silently.
        CorruptCheckpointError: A checksum mismatch (naming file, key and byte
            range), a missing or truncated shard file, or a bad manifest.
        FormatVersionError: The manifest was written by an unknown format version.
        DataPositionError: The checkpoint's data position is of another dataset or of another
            length (both named), after the state was loaded.
    """
    coord = coordinator or default_coordinator(process_group)
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    flat_holder: list[FlatState] = []
    reads: list[RankRead] = []  # this rank's, once planned

    def flat() -> FlatState:
        """The target, flattened once: for this rank's ask, or in ``read``."""
        if not flat_holder:
            flat_holder.append(flatten(state_dict))
        return flat_holder[0]

    with timed() as clock:
        with phase("plan"):
            source = plan_source or planned_at_root(coord, ckdir, flat, strict)

        def read() -> LoadInfo:
            with phase("plan_local"):
                reads.append(source(ckdir, flat(), strict))
            return read_into(ckdir, reads[0], flat())

        with phase("gather_reads"):
            info = gather_or_raise(coord, "load", read, RayckptError)[coord.rank]
        with phase("finish"):
            flat_holder[0].finish_load()
            if data is not None:  # the position came with the plan, from the manifest it was made from
                resume(data, reads[0].data_position, ckdir.location)
    phases = clock.result()
    log_phases("load from", ckdir.location, coord.rank, phases)
    return replace(info, phases=phases)


#: Gives a loading rank its read plan, the checksum blocks, file sizes and stored values.
PlanSource = Callable[[CheckpointDir, FlatState, bool], RankRead]


def plan_from_manifest(ckdir: CheckpointDir, flat: FlatState, strict: bool) -> RankRead:
    """In-process planning: read the manifest and plan this rank's reads."""
    manifest = read_manifest(ckdir)
    plan = create_load_plan(manifest, tensor_requests(flat), flat.values.keys(), strict)
    sizes = {f.path: f.size for f in manifest.files}
    values = manifest_values(manifest, flat.values)
    return RankRead(
        plan=plan, blocks=manifest.blocks, file_sizes=sizes, values=values, data_position=manifest.data_position
    )


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

    def source(ckdir: CheckpointDir, flat: FlatState, strict: bool) -> RankRead:
        if part is None:
            return plan_from_manifest(ckdir, flat, strict)
        if isinstance(part, RayckptError):
            raise part
        plan = part.plan(specs_of(tensor_requests(flat)))
        return RankRead(
            plan=plan,
            blocks=part.blocks,
            file_sizes=part.file_sizes,
            values=part.values,
            data_position=part.data_position,
        )

    return source


def tensor_requests(flat: FlatState) -> list[TensorRequest]:
    return [TensorRequest(t.key, t.dtype, t.shape, box) for t in flat.tensors.values() for box in t.boxes()]
