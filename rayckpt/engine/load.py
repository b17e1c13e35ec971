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

from ..errors import RayckptError
from ..format.manifest import Blocks, manifest_values
from ..phases import log_phases, phase, timed
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
    """Fill ``state_dict`` in place from the checkpoint at ``checkpoint_id``; returns this rank's ``LoadInfo``.

    Called by every rank, with any world size: each rank reads only the byte
    ranges its own shards need. Stateful objects get ``load_state_dict()`` with the
    filled dict once every rank has read its data.

    - Checkpoint keys the target does not ask for are ignored.
    - A key the target asks for that the checkpoint lacks raises
      ``IncompatibleStateError`` listing the keys; ``strict=False`` skips them and leaves
      the targets as they were (listed in ``LoadInfo.missing_keys``).
    - Global shape and dtype mismatches raise ``IncompatibleStateError`` naming the
      key and both sides. A dtype mismatch is never cast silently.
    - Every byte read is verified against its block's checksum (XXH3-64; CRC-32 in
      version-1 checkpoints, which still load); a mismatch raises
      ``CorruptCheckpointError`` naming file, key and byte range. Missing or truncated
      shard files, a manifest path escaping the directory, and an unknown format
      version (``FormatVersionError``) are refused with their own messages. No manifest:
      ``CheckpointNotFoundError``.
    - Returns ``LoadInfo(path, bytes_needed, bytes_read, num_reads, missing_keys,
      requests, bytes_fetched)`` for this rank: ``bytes_needed`` the payload bytes its
      targets needed; ``bytes_read`` the bytes of the plan's ranges (needed bytes
      widened to whole checksum blocks); ``num_reads`` the ranges in the plan;
      ``requests`` the read requests made to storage (ranged GETs on object storage:
      neighbouring ranges share a GET when the bytes between them are few (at most
      1 MiB and 5% of the GET, which spans at most 64 MiB), and a GET longer than
      8 MiB goes as parallel requests of at most 8 MiB, so one large range is not
      one stream; each shard file is opened with one HEAD, which also checks its
      size; ``preadv`` calls and memory-map reads on local files); ``bytes_fetched`` the bytes
      transferred from storage (``bytes_read`` plus the gap bytes coalesced GETs
      fetched and discarded; equal to ``bytes_read`` on local files).
      ``read_amplification`` is ``bytes_fetched / bytes_needed``.
      ``phases``: where this rank's seconds went (plan, check, read, verify, copy,
      waiting for the other ranks; ``LoadInfo.phases``), also logged at DEBUG by the
      ``rayckpt.phases`` logger.
    """
    coord = coordinator or default_coordinator(process_group)
    ckdir = CheckpointDir.resolve(checkpoint_id, filesystem)
    flat_holder: list[FlatState] = []

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
                plan, blocks, sizes, values = source(ckdir, flat(), strict)
            return read_into(ckdir, plan, flat(), blocks, sizes, values)

        with phase("gather_reads"):
            info = gather_or_raise(coord, "load", read, RayckptError)[coord.rank]
        with phase("finish"):
            flat_holder[0].finish_load()
    phases = clock.result()
    log_phases("load from", ckdir.location, coord.rank, phases)
    return replace(info, phases=phases)


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
