"""Save planning at scale, no I/O: the per-box planner every rank ran before, against the column
planner rank 0 runs now, and the bytes each rank sends and receives to agree on the plan.

Layout: ``--tensors`` float32 tensors of shape (``--rows``, ``--cols``), each dim-0 sharded
over the ranks (FSDP2), keys ``layers.{i}.w`` with a value ``step``; ``--replicas 2``
makes it HSDP (each shard held by two ranks: the writers need balancing).

Timed once per rank count (seconds, this process):

- ``before``: ``reference_save_plans`` (the planner as it was), which every rank ran on
  every rank's shards after an all-gather (skipped above ``--before-max``);
- ``after``: rank 0's planning (``assign_writers`` on every rank's ``ShardLayout``), plus
  what one rank does alone (build its layout and hash, turn its part into its plan);
- bytes (pickled, as torch.distributed's object collectives send them): before, each rank
  sent its shards, values, ids, node and paths and received everyone's; after, a header
  every save (and, when the layout changed, its layout) to rank 0, and its own plan back.

    PYTHONPATH=. .venv/bin/python -m benchmarks.micro save-plan --ranks 256 1024 4096
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time
import zlib
from typing import Any

from rayckpt.engine.save_layout import Header, RankLayout, _bits
from rayckpt.planning.load_plan import dim0_boxes
from rayckpt.planning.save_columns import ShardLayout, assign_writers, digest
from rayckpt.planning.save_plan import LocalShard, create_own_plan
from tests.helpers.save_plan_reference import reference_save_plans

NODE = "f" * 56  # a Ray node id's length
SAVE_ID = ("20260101T000000-0badc0de", "")


def size(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def rank_shards(rank: int, world: int, keys: list[str], shape: tuple[int, int], replicas: int) -> list[LocalShard]:
    boxes = dim0_boxes(shape, world // replicas)
    return [LocalShard(k, "float32", shape, boxes[rank % (world // replicas)]) for k in keys]


def rank_layout(shards: list[LocalShard], paths: dict[str, tuple[str, ...]]) -> RankLayout:
    names_hash = digest(repr((("step",), tuple(paths.items()))).encode())
    names = zlib.compress(pickle.dumps((("step",), paths), protocol=5), 1)
    return RankLayout(ShardLayout.from_shards(shards), names, names_hash)


def measure(world: int, args: argparse.Namespace) -> dict[str, Any]:
    keys = [f"layers.{i}.w" for i in range(args.tensors)]
    paths = {k: tuple(k.split(".")) for k in keys} | {"step": ("step",)}
    shape = (args.rows, args.cols)
    out: dict[str, Any] = {"ranks": world}

    t0 = time.perf_counter()
    shards0 = rank_shards(0, world, keys, shape, args.replicas)
    layout0 = rank_layout(shards0, paths)
    hash0 = layout0.hash
    out["one_rank_layout_s"] = time.perf_counter() - t0
    old_part = (True, (shards0, {"step": 1}, SAVE_ID, NODE, paths))
    out["before_sent"] = size(old_part)
    out["before_received"] = world * out["before_sent"]

    if world <= args.before_max:
        all_shards = [rank_shards(r, world, keys, shape, args.replicas) for r in range(world)]
        gc.collect()
        t0 = time.perf_counter()
        old = reference_save_plans(all_shards)
        out["before_plan_s"] = time.perf_counter() - t0
        del all_shards
    else:
        old = None

    layouts = [layout0] + [
        rank_layout(rank_shards(r, world, keys, shape, args.replicas), paths) for r in range(1, world)
    ]
    gc.collect()
    t0 = time.perf_counter()
    assignment = assign_writers([lay.shards for lay in layouts])
    out["after_rank0_plan_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    own = create_own_plan(0, shards0, assignment.written[0].tolist())
    out["one_rank_own_plan_s"] = time.perf_counter() - t0
    if old is not None:
        mine = [
            create_own_plan(r, rank_shards(r, world, keys, shape, args.replicas), w.tolist())
            for r, w in enumerate(assignment.written)
        ]
        out["same_plans"] = mine == old
    assert own.items

    header = (True, Header(layout=hash0, cached=None, node=NODE, values={"step": 1}))
    answer = (True, (SAVE_ID[0], SAVE_ID[1], None, (NODE,)))
    layout_part = (True, layout0)
    plan_part = (True, (digest(hash0), _bits(assignment.written[1], len(layouts[1].shards.entry))))
    out["after_cached_sent"] = size(header)
    out["after_cached_received"] = size(answer)
    out["after_changed_sent"] = size(header) + size(layout_part)
    out["after_changed_received"] = size(answer) + size(plan_part)
    out["after_rank0_received"] = world * (size(header) + size(layout_part))
    out["after_rank0_sent"] = world * (size(answer) + size(plan_part))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[256])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--replicas", type=int, default=1, help="2: HSDP, each shard held by two ranks")
    parser.add_argument("--before-max", type=int, default=1024, help="largest rank count to time the old planner")
    args = parser.parse_args(argv)
    for world in args.ranks:
        row = measure(world, args)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        del row
        gc.collect()
