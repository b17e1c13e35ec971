"""Per-rank functions the multi-process tests run (module-level so spawn can import them)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import rayckpt
from rayckpt.engine import writer
from rayckpt.engine.app_state import AppState
from rayckpt.examples.demo import load_worker
from rayckpt.testing.toy import ToyModel, build_fsdp, fixed_input, full_state, train_steps


def load_many_worker(rank: int, world_size: int, paths: list[str]) -> list[dict[str, Any]]:
    return [load_worker(rank, world_size, p) for p in paths]


def raw_dtensor_worker(rank: int, world_size: int, path: str, mode: str) -> dict[str, Any]:
    """Save or load ``model.state_dict()`` (DTensors) directly, no get_state_dict."""
    model, optim = build_fsdp(world_size, seed=0 if mode == "save" else 99)
    if mode == "save":
        train_steps(model, optim, 2, rank)
        rayckpt.save({"model": model.state_dict()}, path)
    else:
        rayckpt.load({"model": model.state_dict()}, path)
    with torch.no_grad():
        out = model(fixed_input())
    return {"output": out, "full": {k: v.full_tensor() for k, v in model.state_dict().items()}}


class Counter:
    """A user Stateful object with a JSON-able state."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.history: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.history = list(sd["history"])


def app_state_worker(rank: int, world_size: int, path: str, mode: str) -> dict[str, Any]:
    """Model + optimizer + LR scheduler + step + per-rank RNG + a user Stateful."""
    model, optim = build_fsdp(world_size, seed=0 if mode == "save" else 5)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    counter = Counter()
    if mode == "save":
        for _ in range(3):
            train_steps(model, optim, 1, rank)
            sched.step()
            counter.n += 1
            counter.history.append(sched.get_last_lr()[0])
        torch.manual_seed(777 + rank)
    rng = torch.get_rng_state()
    app = AppState(model, optim, scheduler=sched, counter=counter, step=3 if mode == "save" else 0)
    state = {"app": app, f"rng.rank{rank}": rng, "tag": "run-a" if mode == "save" else ""}
    if mode == "save":
        rayckpt.save(state, path)
    else:
        rayckpt.load(state, path)
    return {
        "sched": sched.state_dict(),
        "lr": [g["lr"] for g in optim.param_groups],
        "counter": counter.state_dict(),
        "step": app.extras["step"],
        "rng": state[f"rng.rank{rank}"].clone(),
        "tag": state["tag"],
    }


def hsdp_save_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """HSDP: replicate over mesh dim 0 (2), shard over mesh dim 1 (2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ToyModel()
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_steps(model, optim, 2, rank)
    app = AppState(model, optim, step=2)
    rayckpt.save({"app": app}, path)
    with torch.no_grad():
        out = model(fixed_input())
    return {"state": full_state(app), "output": out}


def failing_save_worker(rank: int, world_size: int, path: str, where: str) -> str:
    """Save where rank 1 fails: in its Stateful (``where='state'``) or mid-write (``'write'``)."""
    model, optim = build_fsdp(world_size, seed=3)
    train_steps(model, optim, 1, rank)
    state: dict[str, Any] = {"app": AppState(model, optim)}
    if rank == 1 and where == "state":

        class Broken:
            def state_dict(self) -> dict[str, Any]:
                raise RuntimeError("dataloader state unavailable")

            def load_state_dict(self, sd: dict[str, Any]) -> None:
                pass

        state["loader"] = Broken()
    if rank == 1 and where == "write":
        real = writer.write_shard_file

        def disk_full(ckdir, rel, chunks, block_size, save_id, fingerprints=False):
            with ckdir.open_output(rel) as out:  # leave a partial file behind
                out.write(b"ARROW1\x00\x00partial")
            raise OSError(28, "No space left on device")

        writer.write_shard_file = disk_full
    try:
        rayckpt.save(state, path)
    except rayckpt.RayckptError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if rank == 1 and where == "write":
            writer.write_shard_file = real
    return "no error"


def files_in(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def barrier_worker(rank: int, world_size: int) -> int:
    dist.barrier()
    return rank


class LocalCheckpointer:
    """The job's checkpointer interface on plain rayckpt.save/load (no Ray): step_<n> dirs."""

    def __init__(self, root: str) -> None:
        self.fs_path = root
        self.restored_metadata: dict[str, Any] = {}

    def restore(self, state: dict[str, Any], data: Any = None) -> int | None:
        steps = sorted(
            int(d.split("_")[1])
            for d in (os.listdir(self.fs_path) if os.path.isdir(self.fs_path) else [])
            if os.path.exists(os.path.join(self.fs_path, d, "manifest.json"))
        )
        if not steps:
            return None
        from rayckpt.storage.checkpoint_dir import CheckpointDir
        from rayckpt.storage.commit import read_manifest

        path = os.path.join(self.fs_path, f"step_{steps[-1]}")
        rayckpt.load(state, path, data=data)
        self.restored_metadata = dict(read_manifest(CheckpointDir.resolve(path)).user_metadata)
        return state["app"].extras["step"]

    def save(
        self,
        step: int,
        state: dict[str, Any],
        metrics: dict[str, Any],
        metadata: dict[str, Any] | None = None,
        data: Any = None,
    ) -> None:
        path = os.path.join(self.fs_path, f"step_{step}")
        rayckpt.save(state, path, metadata={**(metadata or {}), "metrics": metrics}, data=data)

    def wait(self) -> None:
        pass


def train_job_worker(rank: int, world_size: int, config: dict[str, Any], root: str) -> list[dict[str, float]]:
    from rayckpt.examples.gpt_job import train

    torch.set_num_threads(1)
    return train(config, rank, world_size, LocalCheckpointer(root))


class CollectiveStateful:
    """A Stateful whose ``state_dict`` and ``load_state_dict`` each run an all-reduce (as many do).

    Every rank's call contributes this object's ``ident``: when all ranks call their
    objects in the same order, each all-reduce sums one ``ident`` from every rank.
    """

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.weight = torch.full((4,), float(ident))
        self.sums: dict[str, int] = {}

    def _all_reduce(self, phase: str) -> None:
        t = torch.tensor([self.ident], dtype=torch.int64)
        dist.all_reduce(t)
        self.sums[phase] = int(t.item())

    def state_dict(self) -> dict[str, Any]:
        self._all_reduce("save")
        return {"weight": self.weight}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._all_reduce("load")
        self.weight = sd["weight"]


def stateful_order_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Save and load two collective Statefuls held in opposite dict orders on odd and even ranks."""
    names = ["alpha", "beta"] if rank % 2 == 0 else ["beta", "alpha"]
    idents = {"alpha": 1, "beta": 100}
    saved = {name: CollectiveStateful(idents[name]) for name in names}
    rayckpt.save(saved, path)
    loaded = {name: CollectiveStateful(idents[name]) for name in names}
    for obj in loaded.values():
        obj.weight = torch.zeros(4)
    rayckpt.load(loaded, path)
    return {
        "order": names,
        "save": {n: saved[n].sums["save"] for n in names},
        "load": {n: loaded[n].sums["load"] for n in names},
        "weights": {n: loaded[n].weight.tolist() for n in names},
    }


def overwrite_refused_worker(rank: int, world_size: int, path: str) -> str:
    """Save, then save again with ``overwrite=False``: the error every rank gets."""
    rayckpt.save({"w": torch.full((8,), 7.0 + rank)}, path)
    try:
        rayckpt.save({"w": torch.zeros(8)}, path, overwrite=False)
    except rayckpt.CheckpointExistsError as exc:
        return str(exc)
    return "no error"


def sharded_tensor_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Try to save a legacy ShardedTensor: the error, and whether anything was written."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)])
    st = sharded_tensor.zeros(spec, 4, 2)
    try:
        rayckpt.save({"legacy": st}, path)
    except rayckpt.InvalidStateError as exc:
        return {"error": str(exc), "written": os.path.exists(path)}
    return {"error": None, "written": os.path.exists(path)}
