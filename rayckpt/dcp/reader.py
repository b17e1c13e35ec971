"""``StorageReader``: ``dcp.load`` reading any rayckpt checkpoint, resharded by DCP's own planner.

``read_metadata`` turns the manifest into DCP's ``Metadata`` (each tensor's stored boxes
as its chunks, each plain value as DCP's leaves of it, each key's path as the planner
data), so DCP's planner plans N -> M as it does for its own files. ``read_data`` turns
the rank's ``ReadItem``s into rayckpt's read requests: only the byte ranges they need are
read (ranged GETs coalesced on object stores), every block verified, straight into the
planner's targets.
"""

from __future__ import annotations

import io
import os
from typing import Any

import pyarrow.fs as pafs
import torch
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint import StorageReader as _DCPStorageReader
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..engine.reader import LoadInfo, RankRead, read_into
from ..engine.state import FlatState, Piece, TensorLeaf, dtype_name, torch_dtype
from ..errors import CheckpointNotFoundError, IncompatibleStateError
from ..format.boxes import Box
from ..format.manifest import MANIFEST_NAME, Manifest, TensorEntry
from ..format.paths import dcp_path
from ..format.values import decode_value
from ..planning.load_plan import TensorRequest, create_load_plan
from ..storage.checkpoint_dir import CheckpointDir
from ..storage.commit import read_manifest
from .writer import PICKLED_KEY


class StorageReader(_DCPStorageReader):
    """A ``torch.distributed.checkpoint`` storage reader of rayckpt checkpoints.

    ``dcp.load(state, storage_reader=rayckpt.dcp.StorageReader(path))`` loads any rayckpt
    checkpoint (``rayckpt.save``, ``save_async``, the ``Checkpointer``, incremental, on object
    storage, or written by ``rayckpt.dcp.StorageWriter``) into any world size: DCP's planner
    reshards, this reader reads only the byte ranges the plan needs, each block verified.
    ``last_load`` holds this rank's last read (``rayckpt.LoadInfo``). docs/from_dcp.md.

    Args:
        path: The checkpoint (a local path, or a URI ``pyarrow.fs`` understands); None: the
            ``checkpoint_id`` given to ``dcp.load`` (passed to ``reset``).
        filesystem: A ``pyarrow.fs.FileSystem`` the path is on.

    Raises:
        CheckpointNotFoundError: No rayckpt checkpoint at the path; a DCP directory
            (``.metadata``) is named as one, with what reads it.
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, filesystem: pafs.FileSystem | None = None
    ) -> None:
        super().__init__()
        self._filesystem = filesystem
        self._ckdir = _checked(CheckpointDir.resolve(path, filesystem)) if path is not None else None
        self._manifest: Manifest | None = None
        #: DCP's key of each plain value leaf -> (the leaf, whether it is the bytes DCP pickled).
        self._leaves: dict[str, tuple[Any, bool]] = {}
        #: This rank's last ``read_data``: bytes needed, read and fetched, requests (None before any).
        self.last_load: LoadInfo | None = None

    @property
    def checkpoint_id(self) -> str | None:
        return None if self._ckdir is None else self._ckdir.location

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return CheckpointDir.resolve(checkpoint_id).exists(MANIFEST_NAME)
        except Exception:  # noqa: BLE001 - not a location this reader can reach
            return False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._manifest, self._leaves, self.last_load = None, {}, None
        if checkpoint_id is not None:
            self._ckdir = _checked(CheckpointDir.resolve(checkpoint_id, self._filesystem))

    def read_metadata(self) -> Metadata:
        """The manifest as DCP's ``Metadata`` (read on every rank, as DCP's readers do)."""
        if self._ckdir is None:
            raise ValueError(
                "rayckpt.dcp.StorageReader has no location: pass it to StorageReader(path) "
                "or as dcp.load's checkpoint_id"
            )
        manifest = read_manifest(_checked(self._ckdir))
        metadata, self._leaves = dcp_metadata(manifest)
        self._manifest = manifest
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._manifest is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """This rank's items: tensors read in verified byte ranges into the planner's targets, then values."""
        manifest, ckdir = self._manifest, self._ckdir
        assert manifest is not None and ckdir is not None, "read_metadata runs before read_data"
        flat = FlatState()
        requests: list[TensorRequest] = []
        targets: list[tuple[ReadItem, torch.Tensor]] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            key = item.storage_index.fqn
            entry = manifest.entries.get(key)
            target = planner.resolve_tensor(item).detach()
            if not isinstance(entry, TensorEntry):
                raise IncompatibleStateError(f"rayckpt.dcp: key {key!r} is not a tensor in {ckdir.location}")
            if dtype_name(target.dtype) != entry.dtype:
                raise IncompatibleStateError(
                    f"key {key!r}: the checkpoint stores {entry.dtype}, the target is {dtype_name(target.dtype)} "
                    f"(a dtype is never cast silently; {ckdir.location})"
                )
            offsets = item.storage_index.offset or ()
            box = Box(tuple(o + s for o, s in zip(offsets, item.storage_offsets)), tuple(item.lengths))
            leaf = flat.tensors.setdefault(key, TensorLeaf(key=key, pieces=(), shape=entry.shape, dtype=entry.dtype))
            leaf.pieces += (Piece(box, target),)
            requests.append(TensorRequest(key, entry.dtype, entry.shape, box))
            targets.append((item, target))
        if requests:
            load_plan = create_load_plan(manifest, requests)
            sizes = {f.path: f.size for f in manifest.files}
            self.last_load = read_into(ckdir, RankRead(plan=load_plan, blocks=manifest.blocks, file_sizes=sizes), flat)
        for item, target in targets:
            planner.commit_tensor(item, target)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(self._bytes_of(item.storage_index.fqn)))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _bytes_of(self, fqn: str) -> bytes:
        """A value leaf as DCP's planner loads it: DCP's own pickle as stored, else the value ``torch.save``d."""
        value, pickled = self._leaves[fqn]
        if pickled:
            return bytes(value)
        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue()


def _checked(ckdir: CheckpointDir) -> CheckpointDir:
    """``ckdir`` when it holds a committed rayckpt checkpoint; else why not."""
    if ckdir.exists(MANIFEST_NAME):
        return ckdir
    if ckdir.exists(".metadata"):
        raise CheckpointNotFoundError(
            f"{ckdir.location} is a torch.distributed.checkpoint directory (.metadata, .distcp files), not a "
            f"rayckpt checkpoint: read it with torch's FileSystemReader, or convert it once with "
            f"`rayckpt convert {ckdir.location} DST --from dcp`"
        )
    raise CheckpointNotFoundError(f"no rayckpt checkpoint at {ckdir.location} (no {MANIFEST_NAME})")


def _pickled(manifest: Manifest) -> set[str]:
    found = manifest.user_metadata.get(PICKLED_KEY)
    return {k for k in found if isinstance(k, str)} if isinstance(found, list) else set()


def dcp_metadata(manifest: Manifest) -> tuple[Metadata, dict[str, tuple[Any, bool]]]:
    """DCP's ``Metadata`` of a manifest, and each of DCP's value leaves (with whether it is DCP's pickle).

    A tensor's chunks are its stored boxes. A plain value is DCP's leaves of it (DCP walks
    into every dict and into lists holding containers), each a ``BytesStorageMetadata``;
    an item stored as DCP's pickle is one leaf. The planner data is each leaf's path.
    """
    entries: dict[str, Any] = {}
    planner_data: dict[str, tuple[Any, ...]] = {}
    leaves: dict[str, tuple[Any, bool]] = {}
    pickled = _pickled(manifest)
    for key, entry in manifest.entries.items():
        path = dcp_path(entry.path)
        if isinstance(entry, TensorEntry):
            chunks = [ChunkStorageMetadata(torch.Size(c.box.offsets), torch.Size(c.box.sizes)) for c in entry.chunks]
            props = TensorProperties(dtype=torch_dtype(entry.dtype))
            entries[key] = TensorStorageMetadata(props, torch.Size(entry.shape), chunks)
            planner_data[key] = path
            continue
        value = decode_value(entry.value)
        found = [((), value)] if key in pickled else list(_value_leaves(value))
        for sub, leaf in found:
            fqn = ".".join(map(str, path + sub))
            entries[fqn] = BytesStorageMetadata()
            planner_data[fqn] = path + sub
            leaves[fqn] = (leaf, key in pickled)
    meta = StorageMeta(checkpoint_id=None, save_id=manifest.save_id)
    return Metadata(state_dict_metadata=entries, planner_data=planner_data, storage_meta=meta), leaves


def _value_leaves(value: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """DCP's leaves of a plain value: (path inside it, leaf), walked as DCP flattens a state dict."""
    found: list[tuple[tuple[Any, ...], Any]] = []
    traverse_state_dict({"": value}, lambda path, leaf: found.append((tuple(path[1:]), leaf)))
    return found
