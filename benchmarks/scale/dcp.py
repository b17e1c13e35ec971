"""DCP's side of the scale benchmark: its ``.metadata``, save plans and load plans for a ``Layout``."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType

from .layout import Layout, dim0_rows, row_bytes

METADATA_NAME = ".metadata"
#: The save id ``FileSystemWriter`` draws (a uuid4 string), fixed for comparable sizes.
SAVE_ID = "0b1f2e3d-4c5b-4a69-8877-665544332211"


def _copy(s: str) -> str:
    """An equal string that is another object: what each rank's unpickled plan holds."""
    return s.encode().decode()


_TORCH_SAVE_OVERHEAD: list[int] = []


def item_length(nbytes: int) -> int:
    """The bytes ``torch.save`` writes for a tensor of ``nbytes`` (its zip framing measured once)."""
    if not _TORCH_SAVE_OVERHEAD:
        buf = io.BytesIO()
        torch.save(torch.zeros(1), buf)
        _TORCH_SAVE_OVERHEAD.append(len(buf.getvalue()) - 4)
    return _TORCH_SAVE_OVERHEAD[0] + nbytes


def _chunks(layout: Layout, world_size: int) -> dict[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Each shape's (offsets, sizes) on every rank, FSDP2's dim-0 shards."""
    out = {}
    for shape in set(layout.shapes):
        rows = [dim0_rows(shape, world_size, r) for r in range(world_size)]
        out[shape] = [((lo,) + (0,) * (len(shape) - 1), (n,) + shape[1:]) for lo, n in rows]
    return out


def _kept(layout: Layout, chunks: dict[tuple[int, ...], list[Any]]) -> list[list[int]]:
    """Each rank's tensor indices after ``dedup_save_plans``: an empty shard once, on the lowest such rank."""
    keep = {}
    for shape, per_rank in chunks.items():
        empty = [r for r, (_, sizes) in enumerate(per_rank) if sizes[0] == 0]
        keep[shape] = [bool(sizes[0]) or r == empty[0] for r, (_, sizes) in enumerate(per_rank)]
    return [[i for i, s in enumerate(layout.shapes) if keep[s][r]] for r in range(len(next(iter(chunks.values()))))]


def _flatten_mapping(layout: Layout) -> dict[str, tuple[str, ...]]:
    """A rank's ``flatten_state_dict`` mapping: fqn -> path, the path's parts shared as its state dict shares them."""
    parts: dict[str, str] = {}
    out = {}
    for key, path in zip(layout.keys, layout.paths, strict=True):
        name = path[1] if path[0] == "model" else parts.setdefault(path[2], _copy(path[2]))
        out[_copy(key)] = (path[0], _copy(name)) if path[0] == "model" else (*path[:2], name, *path[3:])
    return out


def local_save_plans(layout: Layout, world_size: int) -> list[SavePlan]:
    """Every rank's local ``SavePlan`` as the coordinator receives it (before dedup)."""
    plans = []
    chunks = _chunks(layout, world_size)
    for rank in range(world_size):
        mapping = _flatten_mapping(layout)
        items = []
        for fqn, shape in zip(mapping, layout.shapes, strict=True):
            offsets, sizes = chunks[shape][rank]
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            data = TensorWriteData(
                chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape)
            )
            items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD, tensor_data=data))
        plans.append(SavePlan(items, planner_data=mapping))
    return plans


def build_metadata(layout: Layout, world_size: int, checkpoint_id: str) -> Metadata:
    """The ``Metadata`` ``FileSystemWriter.finish`` pickles for a save of ``layout`` by ``world_size`` ranks."""
    keys = [_copy(k) for k in layout.keys]  # rank 0's plan's fqns
    md: dict[str, Any] = {
        k: TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(s), [])
        for k, s in zip(keys, layout.shapes, strict=True)
    }
    storage: dict[MetadataIndex, _StorageInfo] = {}
    per_shape = _chunks(layout, world_size)
    for rank, kept in enumerate(_kept(layout, per_shape)):
        name, pos = f"__{rank}_0{DEFAULT_SUFFIX}", 0
        for i in kept:
            shape = layout.shapes[i]
            offsets, sizes = per_shape[shape][rank]
            chunks = md[keys[i]].chunks
            index = MetadataIndex(_copy(keys[i]), offsets, len(chunks))
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            length = item_length(sizes[0] * row_bytes(shape))
            storage[index] = _StorageInfo(name, pos, length)
            pos += length
    mapping = _flatten_mapping(layout)
    if world_size > 1:  # keys from the last rank's mapping, values from rank 0's (``dict(ChainMap(...))``)
        mapping = dict(zip(_flatten_mapping(layout), mapping.values(), strict=True))
    meta = StorageMeta(checkpoint_id=Path(checkpoint_id), save_id=SAVE_ID)
    return Metadata(md, planner_data=mapping, storage_data=storage, storage_meta=meta, version=CURRENT_DCP_VERSION)


def metadata_chunks(metadata: Metadata) -> int:
    return sum(len(m.chunks) for m in metadata.state_dict_metadata.values())


def write_metadata(directory: str, metadata: Metadata) -> None:
    """``FileSystemWriter.finish``: pickle to a temporary file, fsync, rename."""
    tmp = os.path.join(directory, METADATA_NAME + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, METADATA_NAME))


def read_metadata(directory: str) -> Metadata:
    """``FileSystemReader.read_metadata``: unpickle ``.metadata``."""
    with open(os.path.join(directory, METADATA_NAME), "rb") as f:
        metadata = pickle.load(f)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = SAVE_ID
    return metadata


def global_plan(plans: list[SavePlan], caching: bool = False) -> tuple[list[SavePlan], Metadata]:
    """``DefaultSavePlanner.create_global_plan`` (dedup, metadata, validation) on the coordinator."""
    return DefaultSavePlanner(enable_plan_caching=caching).create_global_plan(plans)


def clear_plan_cache() -> None:
    for name in ("save_plan", "all_plans", "global_plan", "metadata", "final_save_plan"):
        cache = getattr(SavePlanner, f"_cached_{name}")
        cache.clear()


def hydrate_plan_cache(plans: list[SavePlan]) -> None:
    """Fill the plan cache as a first cached save would (what the cached path returns, unvalidated)."""
    key = DefaultSavePlanner.__name__
    SavePlanner._cached_all_plans[key] = plans
    SavePlanner._cached_global_plan[key] = plans
    SavePlanner._cached_metadata[key] = Metadata({})


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[Any]:
    """A ``fake`` process group of ``world_size`` as ``rank`` and its 1-D CPU mesh (no communication)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def target_state(layout: Layout, mesh: Any) -> dict[str, Any]:
    """One rank's flattened FSDP2 state dict: a ``Shard(0)`` DTensor per tensor over meta local tensors."""
    from torch.distributed.tensor import DTensor, Shard

    world_size, rank = mesh.size(), mesh.get_local_rank()
    out: dict[str, Any] = {}
    for key, shape in zip(layout.keys, layout.shapes, strict=True):
        _, rows = dim0_rows(shape, world_size, rank)
        local = torch.empty((rows,) + shape[1:], dtype=torch.float32, device="meta")
        stride = torch.empty(shape, device="meta").stride()
        out[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
    return out
