"""What DCP itself makes for a scale layout (``benchmarks.scale.layout``): the reference the scale
benchmark's synthetic ``.metadata`` (``benchmarks.scale.dcp.build_metadata``) is checked against."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, DEFAULT_SUFFIX, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from benchmarks.scale.dcp import SAVE_ID, fake_world, item_length, target_state
from benchmarks.scale.layout import ITEMSIZE, Layout, dim0_rows


def _gathered(obj: Any) -> Any:
    """What a collective hands the other side: ``obj`` pickled and unpickled."""
    return pickle.loads(pickle.dumps(obj))


def nested(layout: Layout, flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened state dict nested along the layout's paths, as the model's and the optimizer's are."""
    out: dict[str, Any] = {}
    for key, path in zip(layout.keys, layout.paths, strict=True):
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        # The model's and the optimizer's state dicts name a parameter with strings of their own.
        node[path[-1].encode().decode() if path[0] == "model" else path[-1]] = flat[key]
    return out


def metadata_via_planner(layout: Layout, world_size: int, checkpoint_id: str) -> tuple[Metadata, list[SavePlan]]:
    """``dcp.save``'s planning and finish for the layout: every rank's ``DefaultSavePlanner`` on its
    DTensors, the coordinator's global plan, each rank's writes (``item_length`` bytes each), ``finish``."""
    local = []
    for rank in range(world_size):
        with fake_world(world_size, rank) as mesh:
            planner = DefaultSavePlanner()
            planner.set_up_planner(nested(layout, target_state(layout, mesh)), is_coordinator=rank == 0)
            local.append(_gathered(planner.create_local_plan()))
    plans, metadata = DefaultSavePlanner().create_global_plan(local)
    plans = [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]
    results = []
    for plan in map(_gathered, plans):
        name, pos, written = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}", 0, []
        for item in plan.items:
            sizes = item.tensor_data.chunk.sizes
            length = item_length(sizes.numel() * ITEMSIZE)
            written.append(WriteResult(item.index, length, _StorageInfo(name, pos, length)))
            pos += length
        results.append(_gathered(written))
    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_data = {wr.index: wr.storage_data for written in results for wr in written}
    metadata.storage_meta = StorageMeta(checkpoint_id=Path(checkpoint_id), save_id=SAVE_ID)
    return metadata, local


def real_save_worker(rank: int, world_size: int, layout: Layout, directory: str) -> None:
    """One rank of a real ``dcp.save`` of ``layout`` (zero-filled FSDP2 shards; ``run_ranks`` on gloo)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    state: dict[str, Any] = {}
    for path, shape in zip(layout.paths, layout.shapes, strict=True):
        _, rows = dim0_rows(shape, world_size, rank)
        local = torch.zeros((rows,) + shape[1:])
        node = state
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    dcp.save(state, checkpoint_id=directory)
