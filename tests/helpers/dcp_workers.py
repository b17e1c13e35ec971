"""Rank functions for the DCP storage tests: FSDP2 + AdamW through ``dcp`` with rayckpt's writer and reader."""

from __future__ import annotations

import io
import multiprocessing
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import rayckpt
import rayckpt.dcp
from rayckpt.app_state import AppState
from rayckpt.testing.toy import build_fsdp, fixed_input, full_state, train_steps


class Counter:
    """A Stateful object of the kind DCP saves: its state_dict holds a plain value and a tensor."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.t = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.t = sd["t"]


class Opaque:
    """An object the pickle-free format cannot hold: DCP pickles it."""

    def __init__(self, tag: str) -> None:
        self.tag = tag


def dcp_state(model: Any, optim: Any, counter: Counter, blob: bytes, tag: str) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "counter": counter, "blob": io.BytesIO(blob), "opaque": Opaque(tag)}


def result_of(model: Any, optim: Any) -> dict[str, Any]:
    with torch.no_grad():
        output = model(fixed_input()).float()
    return {"state": full_state(AppState(model, optim)), "output": output}


def save_worker(rank: int, world: int, path: str, mode: str = "sync", steps: int = 3, **writer: Any) -> dict[str, Any]:
    """Train, then ``dcp.save`` (or ``async_save``, waited for before the next step) with rayckpt's writer."""
    model, optim = build_fsdp(world, seed=0)
    train_steps(model, optim, steps, rank)
    counter = Counter(steps)
    counter.t += steps
    state = dcp_state(model, optim, counter, f"blob-{steps}".encode(), f"tag-{steps}")
    w = rayckpt.dcp.StorageWriter(path, **writer)
    if mode == "sync":
        dcp.save(state, storage_writer=w)
    else:
        kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        if mode == "process":
            # run_ranks' processes are daemonic, and DCP's checkpoint process is their child
            multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
        stager = rayckpt.dcp.Stager() if mode == "stager" else None
        fut = dcp.async_save(state, storage_writer=w, async_checkpointer_type=kind, async_stager=stager)
        train_steps(model, optim, 0, rank)
        fut.result()
        if stager is not None:
            stager.close()
    return result_of(model, optim)


def load_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    """A fresh, differently initialized model: ``dcp.load`` with rayckpt's reader, then ``set_state_dict``."""
    model, optim = build_fsdp(world, seed=1234)
    counter = Counter()
    state = dcp_state(model, optim, counter, b"", "")
    reader = rayckpt.dcp.StorageReader(path)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out = result_of(model, optim)
    out.update(
        counter=(counter.n, counter.t.clone()),
        blob=state["blob"].getvalue(),
        opaque=state["opaque"].tag,
        info=reader.last_load,
    )
    return out


def rayckpt_save_worker(rank: int, world: int, path: str, steps: int = 3, **kwargs: Any) -> dict[str, Any]:
    """Train and save with ``rayckpt.save`` (the state as DCP's helpers give it), for DCP to read back."""
    model, optim = build_fsdp(world, seed=0)
    train_steps(model, optim, steps, rank)
    msd, osd = get_state_dict(model, optim)
    rayckpt.save({"model": msd, "optim": osd}, path, **kwargs)
    return result_of(model, optim)


def plain_load_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    """``dcp.load`` of model and optimizer only (what ``rayckpt.save`` stored) with rayckpt's reader."""
    model, optim = build_fsdp(world, seed=1234)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    reader = rayckpt.dcp.StorageReader(path)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out = result_of(model, optim)
    out["info"] = reader.last_load
    return out


def rayckpt_info_worker(rank: int, world: int, path: str) -> Any:
    """``rayckpt.load`` of model and optimizer: its ``LoadInfo`` (what it read), to hold the reader's against."""
    model, optim = build_fsdp(world, seed=1234)
    msd, osd = get_state_dict(model, optim)
    return rayckpt.load({"model": msd, "optim": osd}, path, strict=False)


def rayckpt_load_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    """``rayckpt.load`` of what ``dcp.save`` wrote with rayckpt's writer (DCP's own state dict layout)."""
    model, optim = build_fsdp(world, seed=1234)
    msd, osd = get_state_dict(model, optim)
    counter = Counter()
    state = {"model": msd, "optim": osd, "counter": counter, "blob": io.BytesIO()}
    rayckpt.load(state, path, strict=False)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out = result_of(model, optim)
    out.update(counter=(counter.n, counter.t.clone()), blob=state["blob"].getvalue())
    return out


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def gpt_save_worker(rank: int, world: int, path: str) -> torch.Tensor:
    """The GPT with its head tied to the embedding, FSDP2, a step of AdamW, ``dcp.save``; its logits."""
    model, optim = _gpt(world, seed=0)
    tokens = torch.arange(64).reshape(2, 32) % 64
    optim.zero_grad()
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=rayckpt.dcp.StorageWriter(path))
    with torch.no_grad():
        return model(tokens).detach().clone()


def gpt_load_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    """A fresh tied GPT loaded with ``dcp.load`` and rayckpt's reader: its logits, and whether the tie holds."""
    model, optim = _gpt(world, seed=99)
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, storage_reader=rayckpt.dcp.StorageReader(path))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    tokens = torch.arange(64).reshape(2, 32) % 64
    with torch.no_grad():
        logits = model(tokens).detach().clone()
    return {"logits": logits, "tied": model.head.weight is model.tok_emb.weight}


def _gpt(world: int, seed: int) -> tuple[Any, Any]:
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    from rayckpt.examples.gpt import GPT, GPTConfig, shard_model

    torch.manual_seed(seed)
    model = shard_model(GPT(dataclasses.replace(GPTConfig.tiny(), tie_head=True)), init_device_mesh("cpu", (world,)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


class _DyingPlanner(dcp.DefaultSavePlanner):
    """Kills rank ``victim``'s process while the writer resolves its first tensor (a rank dying mid-save)."""

    def __init__(self, victim: int) -> None:
        super().__init__()
        self.victim = victim

    def resolve_data(self, write_item: Any) -> Any:
        if torch.distributed.get_rank() == self.victim:
            os._exit(9)
        return super().resolve_data(write_item)


def dying_save_worker(rank: int, world: int, path: str) -> str:
    """Save once; then a second save in which rank 1 dies while writing. Returns how the second save ended here."""
    model, optim = build_fsdp(world, seed=0)
    train_steps(model, optim, 1, rank)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=rayckpt.dcp.StorageWriter(path))
    train_steps(model, optim, 1, rank)
    msd, osd = get_state_dict(model, optim)
    try:
        dcp.save({"model": msd, "optim": osd}, storage_writer=rayckpt.dcp.StorageWriter(path), planner=_DyingPlanner(1))
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException, or gloo's error
        return type(exc).__name__
    return "saved"


def save_many(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every synchronous save the tests read back, in one process group (names -> this rank's result).

    ``dcp``: ``dcp.save`` with rayckpt's writer after 3 steps. ``rayckpt``: ``rayckpt.save``. ``chain``: two
    ``rayckpt.save(incremental=True)``, the second after a step. ``dinc-1``/``dinc-2``/``dinc-3``: the writer with
    ``incremental=True``: a save, the same state again (every chunk shared), a save after a step. ``gpt``: the tied GPT.
    """
    out: dict[str, Any] = {"dcp": save_worker(rank, world, f"{root}/dcp")}
    out["rayckpt"] = rayckpt_save_worker(rank, world, f"{root}/rayckpt")
    model, optim = build_fsdp(world, seed=0)
    for i in (1, 2):
        train_steps(model, optim, 1, rank)
        msd, osd = get_state_dict(model, optim)
        out[f"chain-{i}-info"] = rayckpt.save({"model": msd, "optim": osd}, f"{root}/chain/{i}", incremental=True)
    out["chain"] = result_of(model, optim)
    model, optim = build_fsdp(world, seed=0)
    train_steps(model, optim, 1, rank)
    for i in (1, 2, 3):
        if i == 3:
            train_steps(model, optim, 1, rank)
        msd, osd = get_state_dict(model, optim)
        w = rayckpt.dcp.StorageWriter(f"{root}/dinc/{i}", incremental=True)
        dcp.save({"model": msd, "optim": osd}, storage_writer=w)
        out[f"dinc-{i}"] = result_of(model, optim)
    out["gpt"] = gpt_save_worker(rank, world, f"{root}/gpt")
    return out


def load_many(rank: int, world: int, root: str) -> dict[str, Any]:
    """``dcp.load`` with rayckpt's reader of every checkpoint ``save_many`` wrote, into ``world`` ranks."""
    out: dict[str, Any] = {"dcp": load_worker(rank, world, f"{root}/dcp")}
    for name in ("rayckpt", "chain/2", "dinc/1", "dinc/2", "dinc/3"):
        out[name] = plain_load_worker(rank, world, f"{root}/{name}")
    out["gpt"] = gpt_load_worker(rank, world, f"{root}/gpt")
    out["rayckpt.load"] = rayckpt_load_worker(rank, world, f"{root}/dcp")
    return out


def async_many(rank: int, world: int, root: str) -> dict[str, Any]:
    """``dcp.async_save`` with rayckpt's writer: in a thread (DCP's stager), with rayckpt's ``Stager`` (twice,
    the buffer reused: the second save is the one kept), and in a background process."""
    out = {"thread": save_worker(rank, world, f"{root}/thread", "thread")}
    model, optim = build_fsdp(world, seed=0)
    stager = rayckpt.dcp.Stager()
    for steps in (2, 3):
        train_steps(model, optim, 1 if steps == 3 else 2, rank)
        counter = Counter(steps)
        counter.t += steps
        state = dcp_state(model, optim, counter, f"blob-{steps}".encode(), f"tag-{steps}")
        w = rayckpt.dcp.StorageWriter(f"{root}/stager")
        fut = dcp.async_save(state, storage_writer=w, async_stager=stager)
        fut.result()  # waited for before the optimizer's next step
    stager.close()
    out["stager"] = result_of(model, optim)
    out["process"] = save_worker(rank, world, f"{root}/process", "process")
    return out


def load_async(rank: int, world: int, root: str) -> dict[str, Any]:
    """The async saves loaded with rayckpt's reader."""
    return {name: load_worker(rank, world, f"{root}/{name}") for name in ("thread", "stager", "process")}
