"""``StorageWriter``: ``dcp.save`` writing a rayckpt checkpoint, on DCP's own plan and collectives.

DCP runs a save in its steps: every rank ``set_up_storage_writer`` and
``prepare_local_plan``, the coordinator ``prepare_global_plan`` (on the plans DCP's
planner deduplicated), every rank ``write_data``, the coordinator ``finish``. rayckpt's
save maps onto them: the coordinator claims the location with a lease, picks the save
id, the block size and the base of an incremental save and sends them to every rank with
its plan (global plan: DCP runs it only when no rank's local steps failed), each rank
writes its items as Arrow shard files with a checksum per block (write), and the
coordinator commits the manifest last, atomically (finish). No collective of rayckpt's
own runs: DCP's carry everything.
"""

from __future__ import annotations

import io
import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow.fs as pafs
import torch
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..engine.increments import FULL, Increment, choose_base, confirm_base, forget_choice
from ..engine.save import full_every_count
from ..engine.state import as_bytes, dtype_name
from ..engine.writer import ShareSpec, parts_here, write_rank_share
from ..errors import InvalidStateError, SaveFailedError
from ..format.boxes import Box, split_box
from ..format.manifest import MANIFEST_NAME, itemsize
from ..format.paths import Path
from ..format.shard_file import ChunkData, auto_block_size
from ..format.values import encode_value
from ..planning.save_plan import MAX_CHUNK_BYTES
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import SaveSpec, WrittenFiles, WrittenShard, commit_save, new_save_id, remove_failed_save
from ..storage.lease import LeaseKeeper, claim_location, release_lease
from ..storage.shared import keeps_name

log = logging.getLogger("rayckpt.dcp")

#: The manifest's ``user_metadata`` key listing the items stored as the bytes DCP pickled.
PICKLED_KEY = "rayckpt.dcp.pickled"


@dataclass(frozen=True, slots=True)
class _Order:
    """What the coordinator sends every rank with its plan (``SavePlan.storage_data``)."""

    save_id: str
    block_size: int
    increment: Increment


@dataclass(frozen=True, slots=True)
class _Written:
    """What a rank reports to ``finish`` (the first ``WriteResult``'s ``storage_data``)."""

    shard: WrittenShard
    #: Key -> the stored (tagged JSON) form of each non-tensor item this rank wrote.
    values: dict[str, Any]
    #: The keys among ``values`` that hold the bytes DCP pickled.
    pickled: tuple[str, ...]


class _Claim:
    """The coordinator's save in flight: its lease, kept fresh until the commit or the writer's next save."""

    def __init__(self, ckdir: CheckpointDir, save_id: str, previous: str, increment: Increment) -> None:
        self.ckdir, self.save_id, self.previous, self.increment = ckdir, save_id, previous, increment
        self.keeper = LeaseKeeper(ckdir, save_id)
        self.keeper.__enter__()
        self.finalizer: Any = None

    def end(self, committed: bool) -> None:
        """Stop refreshing the lease and delete it; a save that did not commit loses its files too."""
        self.keeper.__exit__(None, None, None)
        if not committed:
            release_lease(self.ckdir, self.save_id)
            remove_failed_save(self.ckdir, self.save_id)
            forget_choice(self.save_id)
        if self.finalizer is not None:
            self.finalizer.detach()


class StorageWriter(_DCPStorageWriter):
    """A ``torch.distributed.checkpoint`` storage writer whose checkpoints are rayckpt checkpoints.

    ``dcp.save(state, storage_writer=rayckpt.dcp.StorageWriter(path))`` (or ``dcp.async_save``)
    writes Arrow shard files with a checksum per block and commits the manifest last; every
    rayckpt reader (``rayckpt.load`` under any world size, ``rayckpt verify``, ``inspect``,
    ``convert``, ``gc``, ``rayckpt.dcp.StorageReader``) reads it. DCP's planner still decides
    which rank writes each item (replicated items once). Non-tensor items are stored as rayckpt
    values when they are JSON-able (or ``bytes``/``io.BytesIO``), else as the bytes DCP pickled
    (listed in the manifest's ``user_metadata["rayckpt.dcp.pickled"]``; rayckpt never unpickles
    them, DCP's load planner does). docs/from_dcp.md.

    Args:
        path: Where the checkpoint goes (a local path, or a URI ``pyarrow.fs`` understands);
            None: the ``checkpoint_id`` given to ``dcp.save`` (passed to ``reset``).
        filesystem: A ``pyarrow.fs.FileSystem`` the path is on.
        overwrite: Whether a checkpoint committed at the location is replaced (atomically);
            False: such a save is refused.
        incremental: Share every chunk unchanged since this process's last incremental save
            beside the location, as ``rayckpt.save(incremental=True)``.
        full_every: With ``incremental``: every ``full_every``-th save shares nothing (0: never).
        block_size: Bytes per block checksum; None: chosen from the state's size.
        metadata: JSON-able data for the manifest's ``user_metadata``.

    Raises:
        ValueError: ``full_every`` is not a whole number >= 0, or ``block_size`` is not positive.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        filesystem: pafs.FileSystem | None = None,
        overwrite: bool = True,
        incremental: bool = False,
        full_every: int = 0,
        block_size: int | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        full_every_count(full_every)
        if block_size is not None and (type(block_size) is not int or block_size <= 0):
            raise ValueError(f"block_size must be a positive whole number of bytes, got {block_size!r}")
        self._filesystem = filesystem
        self._ckdir = CheckpointDir.resolve(path, filesystem) if path is not None else None
        self._overwrite, self._incremental, self._full_every = overwrite, incremental, full_every
        self._block_size, self._metadata = block_size, dict(metadata or {})
        self._rank = 0
        self._claim: _Claim | None = None
        self._order: _Order | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``async_save`` in a process): the options and location, never a save in flight."""
        state = dict(self.__dict__)
        state["_claim"] = None
        state["_order"] = None
        return state

    @property
    def checkpoint_id(self) -> str | None:
        """The location, credentials redacted (what DCP's logs name)."""
        return None if self._ckdir is None else self._ckdir.location

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            CheckpointDir.resolve(checkpoint_id)
        except Exception:  # noqa: BLE001 - not a location this writer can reach
            return False
        return True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._end_claim(committed=False)
        if checkpoint_id is not None:
            self._ckdir = CheckpointDir.resolve(checkpoint_id, self._filesystem)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank: the location and options checked; a save of this writer's still in flight is ended."""
        self._end_claim(committed=False)
        if self._ckdir is None:
            raise ValueError(
                "rayckpt.dcp.StorageWriter has no location: pass it to StorageWriter(path) "
                "or as dcp.save's checkpoint_id"
            )
        self._rank = int(kwargs.get("rank", 0))
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if kwargs.get("use_collectives", True) is False and world > 1:
            raise ValueError(
                "rayckpt.dcp.StorageWriter needs dcp.save's use_collectives=True: a rayckpt checkpoint is one "
                "commit of every rank's files, which use_collectives=False never makes"
            )

    def _claim_location(self, ckdir: CheckpointDir) -> _Claim:
        save_id = new_save_id()
        if self._incremental:
            choose_base(ckdir, save_id, self._full_every)
        try:
            previous = claim_location(ckdir, save_id, overwrite=self._overwrite)
        except BaseException:
            forget_choice(save_id)
            ckdir.delete(keeps_name(save_id))
            if not ckdir.exists(MANIFEST_NAME):
                ckdir.delete_dir_if_empty()
            raise
        increment = confirm_base(ckdir, save_id) if self._incremental else FULL
        claim = _Claim(ckdir, save_id, previous, increment)
        claim.finalizer = weakref.finalize(self, claim.end, False)
        return claim

    def _end_claim(self, committed: bool) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.end(committed)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse, naming its key, an item the format cannot store (before anything is written)."""
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            if item.tensor_data is None:
                raise InvalidStateError(
                    f"rayckpt.dcp: item {item.index.fqn!r} is a {item.type.name} without tensor data"
                )
            dtype = dtype_name(item.tensor_data.properties.dtype)
            try:
                itemsize(dtype)
            except InvalidStateError as exc:
                raise InvalidStateError(f"rayckpt.dcp: item {item.index.fqn!r}: {exc}") from None
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator: claims the location for a new save id (refused while another save holds it), then
        sends every rank the save id, block size and base of an incremental save with its plan.

        DCP runs this step only when every rank's local steps succeeded, so a refused item claims nothing."""
        if self._ckdir is None:
            raise SaveFailedError("rayckpt.dcp: prepare_global_plan ran before set_up_storage_writer")
        self._end_claim(committed=False)
        claim = self._claim = self._claim_location(self._ckdir)
        total = sum(_item_bytes(i) for p in plans for i in p.items if i.type != WriteItemType.BYTE_IO)
        order = _Order(claim.save_id, self._block_size or auto_block_size(total), claim.increment)
        return [replace(p, storage_data=order) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank: its items into its own shard files, durable before this returns."""
        order = plan.storage_data
        if not isinstance(order, _Order) or self._ckdir is None:
            raise SaveFailedError(f"rayckpt.dcp: rank {self._rank} got a plan without rayckpt's save order")
        self._order = order
        chunks: list[ChunkData] = []
        values: dict[str, Any] = {}
        pickled: list[str] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                stored, raw = _stored_object(planner, item)
                values[item.index.fqn] = stored
                if raw:
                    pickled.append(item.index.fqn)
            else:
                chunks.extend(_chunks_of(item, planner.resolve_data(item)))
        files = WrittenFiles(self._ckdir, order.save_id)
        with files:  # a failure removes what this rank wrote
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            share = ShareSpec(
                rank=self._rank, block_size=order.block_size, max_parts=parts_here(world, 1), increment=order.increment
            )
            shard = (
                write_rank_share(files, chunks, share) if chunks else WrittenShard(self._rank, (), (), order.save_id)
            )
        written = _Written(shard, values, tuple(pickled))
        results = [
            WriteResult(index=item.index, size_in_bytes=_item_bytes(item), storage_data=written if i == 0 else None)
            for i, item in enumerate(plan.items)
        ] or [WriteResult(index=MetadataIndex(""), size_in_bytes=0, storage_data=written)]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator: the manifest, written last and atomically (the commit), then the lease released."""
        claim, order = self._claim, self._order
        if claim is None or order is None or self._ckdir is None:
            raise SaveFailedError("rayckpt.dcp: finish ran on a rank that did not claim the location")
        written = [r.storage_data for rank in results for r in rank if isinstance(r.storage_data, _Written)]
        values = {k: v for w in written for k, v in w.values.items()}
        pickled = sorted(k for w in written for k in w.pickled)
        user = dict(self._metadata)
        if pickled:
            user[PICKLED_KEY] = pickled
        spec = SaveSpec(
            save_id=claim.save_id,
            world_size=len(results),
            block_size=order.block_size,
            tensors=_tensors_of(metadata),
            values=values,
            metadata=user,
            paths=_paths_of(metadata, values),
            previous=claim.previous,
        )
        try:
            commit_save(self._ckdir, spec, [w.shard for w in written])
        except BaseException:
            self._end_claim(committed=False)
            raise
        self._end_claim(committed=True)


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return (
        item.tensor_data.chunk.sizes.numel() * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
    )


def _chunks_of(item: WriteItem, tensor: Any) -> list[ChunkData]:
    """The chunks of one tensor item: its box (split under Arrow's 2 GiB limit), bytes on the CPU."""
    if not isinstance(tensor, torch.Tensor) or item.tensor_data is None:
        raise InvalidStateError(
            f"rayckpt.dcp: item {item.index.fqn!r}: the planner resolved a {type(tensor).__name__}, not a tensor"
        )
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.to("cpu")
    dtype = dtype_name(item.tensor_data.properties.dtype)
    box = Box(tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes))
    data = data.reshape(box.sizes)
    out = []
    for piece in split_box(box, itemsize(dtype), MAX_CHUNK_BYTES):
        out.append(
            ChunkData(item.index.fqn, dtype, piece, as_bytes(data[piece.relative_to(box).to_slices()].contiguous()))
        )
    return out


def _stored_object(planner: SavePlanner, item: WriteItem) -> tuple[Any, bool]:
    """A non-tensor item's stored form, and whether it is the bytes DCP pickled.

    The planner's object itself when the pickle-free format holds it (a JSON-able value,
    ``bytes``, ``io.BytesIO``); else what ``resolve_data`` gives (DCP's pickle), kept as bytes.
    """
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        obj = lookup(item.index)
        try:
            return encode_value(obj, item.index.fqn), False
        except InvalidStateError:
            pass
    data = planner.resolve_data(item)
    if isinstance(data, io.BytesIO):
        raw = data.getvalue()
    elif isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    else:
        raise InvalidStateError(
            f"rayckpt.dcp: item {item.index.fqn!r}: the planner resolved a {type(data).__name__}, not io.BytesIO"
        )
    return encode_value(raw, item.index.fqn), True


def _tensors_of(metadata: Metadata) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {
        fqn: (dtype_name(md.properties.dtype), tuple(md.size))
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def _paths_of(metadata: Metadata, values: dict[str, Any]) -> dict[str, Path]:
    """Each key's path as DCP's planner recorded it (``planner_data``: the nesting that was saved)."""
    found = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    out: dict[str, Path] = {}
    for fqn in list(metadata.state_dict_metadata) + list(values):
        path = found.get(fqn)
        if isinstance(path, Sequence) and path and all(type(p) in (str, int) for p in path):
            if ".".join(map(str, path)) == fqn:
                out[fqn] = tuple(path)
    return out
