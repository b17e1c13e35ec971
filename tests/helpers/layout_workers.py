"""Per-rank functions for the DCP layout tests: DTensors on a sub-mesh and uneven local shards.

Module-level so spawn can import them. Each layout is built along dim 0 of a
2-d tensor, and each rank reports what it holds as ``(first row, local
tensor)`` pairs worked out from how the layout was built (not from rayckpt), so
the test can compare every held row with the expected tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

import rayckpt

#: (first row, local tensor) for each local shard a rank holds.
Held = list[tuple[int, torch.Tensor]]

SUB_SHAPE = (7, 3)
REP_SHAPE = (5,)
UNEVEN_SHAPE = (16, 2)
#: Rows per rank, 4 ranks: uneven sizes, one shard each.
ROWS_4_3_4_5 = [[(0, 4)], [(4, 7)], [(7, 11)], [(11, 16)]]
#: Rank 0 holds two shards, rank 1 none.
ROWS_TWO_AND_NONE = [[(0, 2), (5, 8)], [], [(2, 5)], [(8, 16)]]


def expected(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full tensor a test saves: random values, the same on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def sharded(full: torch.Tensor, mesh: DeviceMesh) -> tuple[DTensor, Held]:
    """``full`` as Shard(0) over the 1-d ``mesh`` (``torch.chunk`` sizes): nothing held off the mesh."""
    d = distribute_tensor(full, mesh, [Shard(0)])
    coord = mesh.get_coordinate()
    if coord is None:
        return d, []
    rows = full.shape[0]
    per = -(-rows // mesh.size())
    return d, [(min(coord[0] * per, rows), d.to_local())]


def uneven(full: torch.Tensor, mesh: DeviceMesh, spans: list[tuple[int, int]]) -> tuple[DTensor, Held]:
    """``full`` as a DTensor over ``mesh`` whose local shards are this rank's row ``spans`` (a LocalShardsWrapper)."""
    shards = [full[lo:hi].clone() for lo, hi in spans]
    offsets = [(lo,) + (0,) * (full.ndim - 1) for lo, _ in spans]
    local = LocalShardsWrapper(shards, offsets)
    d = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, stride=full.stride(), run_check=False)
    return d, [(lo, s) for (lo, _), s in zip(spans, shards)]


def submesh_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Save DTensors that live on ranks [0, 2] of 4, then load them into other layouts.

    Saved: ``sub`` (Shard(0)), ``rep`` (Replicate) and the scalar ``s`` (Replicate)
    on the sub-mesh, and a plain tensor ``plain`` on every rank. Each load is
    strict and starts from zeros; per target, what this rank holds after it.
    """
    sub_mesh = DeviceMesh("cpu", [0, 2])
    other_mesh = DeviceMesh("cpu", [1, 3])
    all_mesh = init_device_mesh("cpu", (world_size,))
    sub, rep = expected(SUB_SHAPE, 1), expected(REP_SHAPE, 2)
    state = {
        "sub": distribute_tensor(sub, sub_mesh, [Shard(0)]),
        "rep": distribute_tensor(rep, sub_mesh, [Replicate()]),
        "s": distribute_tensor(torch.tensor(2.5), sub_mesh, [Replicate()]),
        "plain": torch.arange(6.0),
    }
    rayckpt.save(state, path)
    out: dict[str, Any] = {"in_sub_mesh": sub_mesh.get_coordinate() is not None}
    for name, mesh in (("same", sub_mesh), ("other", other_mesh), ("all", all_mesh)):
        target_sub, held = sharded(torch.zeros(SUB_SHAPE), mesh)
        target_rep = distribute_tensor(torch.zeros(REP_SHAPE), mesh, [Replicate()])
        target_s = distribute_tensor(torch.tensor(0.0), mesh, [Replicate()])
        target = {"sub": target_sub, "rep": target_rep, "s": target_s, "plain": torch.zeros(6)}
        before = target_sub.to_local().data_ptr()
        rayckpt.load(target, path, strict=True)
        inside = mesh.get_coordinate() is not None
        out[name] = {
            "sub": held,
            "rep": target_rep.to_local() if inside else None,
            "s": target_s.to_local() if inside else None,
            "plain": target["plain"],
            # Off the mesh the DTensor's (empty) local tensor is left as it was.
            "untouched": inside or (target_sub.to_local().numel() == 0 and target_sub.to_local().data_ptr() == before),
        }
    return out


def uneven_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save three layouts of one tensor (4/3/4/5 rows, two-and-none, even Shard(0)) and load each into the others.

    Returns, per (saved layout, target layout), what this rank holds after a
    strict load into zeros.
    """
    mesh = init_device_mesh("cpu", (world_size,))
    full = expected(UNEVEN_SHAPE, 3)
    layouts = {
        "4_3_4_5": lambda t: uneven(t, mesh, ROWS_4_3_4_5[rank]),
        "two_and_none": lambda t: uneven(t, mesh, ROWS_TWO_AND_NONE[rank]),
        "even": lambda t: sharded(t, mesh),
    }
    for name, build in layouts.items():
        rayckpt.save({"w": build(full)[0]}, f"{root}/{name}")
    out: dict[tuple[str, str], Held] = {}
    for saved in layouts:
        for name, build in layouts.items():
            target, held = build(torch.zeros(UNEVEN_SHAPE))
            rayckpt.load({"w": target}, f"{root}/{saved}", strict=True)
            out[(saved, name)] = held
    return out
