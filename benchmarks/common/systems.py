"""The systems every benchmark measures, each behind one adapter: rayckpt, rayckpt on Ray, its memory
tier, DCP, DCP async, ``torch.save`` and a bare copy; a checkpoint's place (``Where``) is a local
directory or a prefix on an S3 endpoint, the same calls for both. ``save`` and ``load`` run any of
them by name."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Where:
    """Where checkpoints go: under ``root``, a local directory, or on ``endpoint`` (an ``S3Endpoint``)."""

    root: str
    endpoint: Any = None

    def uri(self, rel: str) -> str:
        """rayckpt's path (``s3://`` URI on an endpoint) of ``rel``."""
        return self.endpoint.uri(rel) if self.endpoint else os.path.join(self.root, rel)

    def delete(self, rel: str) -> None:
        if self.endpoint:
            self.endpoint.delete(rel)
            return
        path = os.path.join(self.root, rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)

    def files(self, rel: str) -> list[str]:
        """The local files of ``rel`` (none on an endpoint: the page cache is the server's)."""
        from benchmarks.common.diskio import files_under

        path = os.path.join(self.root, rel)
        if self.endpoint or not os.path.exists(path):
            return []
        return files_under(path) if os.path.isdir(path) else [path]

    def dcp_writer(self, rel: str) -> Any:
        import torch.distributed.checkpoint as dcp

        if not self.endpoint:
            return dcp.FileSystemWriter(os.path.join(self.root, rel))
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(f"s3://{self.endpoint.fs_path(rel)}", **self._s3fs())

    def dcp_reader(self, rel: str, **options: Any) -> Any:
        """DCP's reader; ``options`` go to s3fs on an endpoint (e.g. ``default_cache_type="none"``)."""
        import torch.distributed.checkpoint as dcp

        if not self.endpoint:
            return dcp.FileSystemReader(os.path.join(self.root, rel))
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(f"s3://{self.endpoint.fs_path(rel)}", **self._s3fs(), **options)

    def _s3fs(self) -> dict[str, Any]:
        """A fresh s3fs instance each time: no listing cache carried over, as in a new process."""
        return {"endpoint_url": f"http://{self.endpoint.host_port}", "skip_instance_cache": True}


def local(path: str) -> tuple[Where, str]:
    """A local path as (``Where``, rel): for the benchmarks that name one directory."""
    return Where(os.path.dirname(path) or "."), os.path.basename(path)


def rayckpt_save(state: Any, where: Where, rel: str, **kwargs: Any) -> Any:
    import rayckpt

    return rayckpt.save(state, where.uri(rel), **kwargs)


def rayckpt_load(state: Any, where: Where, rel: str) -> Any:
    import rayckpt

    return rayckpt.load(state, where.uri(rel))


def ray_save(state: Any, where: Where, rel: str, run: str, step: int, **kwargs: Any) -> Any:
    """``rayckpt.ray.save_async``: its ``SaveHandle``."""
    from rayckpt.ray import save_async

    return save_async(state, where.uri(rel), run=run, step=step, **kwargs)


def prepare_staging(state: Any, **kwargs: Any) -> None:
    """The rank's staging buffer made before the first save, as ``Checkpointer.restore`` does."""
    from rayckpt.ray import prepare_staging as prepare

    prepare(state, **kwargs)


def local_tensors(state: Any) -> list[Any]:
    """The rank's local tensors of ``state`` (a DTensor's local shard), as a save copies them."""
    from rayckpt.ray.rank.staging import local_pieces

    return local_pieces(state)


def staging_ready() -> None:
    """Wait until the staging buffer ``prepare_staging`` started making in the background is made."""
    from rayckpt.ray.rank import async_save

    async_save.saver().buffer.ready()


def release_staging() -> None:
    from rayckpt.ray import release_staging as release

    release()


def dcp_save(state: Any, where: Where, rel: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=where.dcp_writer(rel))


def dcp_load(state: Any, where: Where, rel: str, **options: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=where.dcp_reader(rel, **options))


def dcp_stager(options: tuple[bool, bool, bool, bool] | None) -> Any:
    """A ``DefaultStager`` with ``StagingOptions(*options)`` (pinned, shared, async staging, non-blocking)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(*options)) if options is not None else None


@dataclass(slots=True)
class DcpAsync:
    """A ``dcp.async_save`` in flight: its upload, and its staging where the stager runs it apart."""

    upload: Any
    staging: Any

    def staged(self) -> None:
        if self.staging is not None:
            self.staging.result()

    def result(self) -> None:
        self.staged()
        self.upload.result()


def dcp_async_save(state: Any, where: Where, rel: str, group: Any = None, stager: Any = None) -> DcpAsync:
    """``dcp.async_save`` (its own gloo ``group``, as DCP's docs ask; a reused ``stager``)."""
    import torch.distributed.checkpoint as dcp

    kwargs = {"async_stager": stager} if stager is not None else {}
    response = dcp.async_save(state, storage_writer=where.dcp_writer(rel), process_group=group, **kwargs)
    return DcpAsync(getattr(response, "upload_completion", response), getattr(response, "staging_completion", None))


def torch_save(full: dict[str, Any], path: str) -> None:
    """``torch.save`` of a full state dict, then fsync: durable as the checkpoint systems' saves are."""
    import torch

    with open(path, "wb") as f:
        torch.save(full, f)
        f.flush()
        os.fsync(f.fileno())


def full_state(model: Any, optim: Any) -> dict[str, Any]:
    """The full state dict ``torch.save`` saves (a collective; every rank gets it, on the CPU)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def torch_load(model: Any, optim: Any, path: str) -> tuple[float, dict[str, Any]]:
    """``torch.load`` of a full state dict and ``set_state_dict`` into the model; the read's seconds and
    the dict's other entries (e.g. ``step``)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    t0 = time.perf_counter()
    sd = torch.load(path, weights_only=True)
    read_s = time.perf_counter() - t0
    options = StateDictOptions(full_state_dict=True)
    set_state_dict(model, optim, model_state_dict=sd.pop("model"), optim_state_dict=sd.pop("optim"), options=options)
    return read_s, sd


#: The systems ``save`` runs by name.
SAVES = ("rayckpt", "rayckpt_incremental", "rayckpt_ray", "dcp", "dcp_async")


def save(system: str, state: Any, where: Where, rel: str, **options: Any) -> dict[str, Any]:
    """One save by ``system`` (of ``SAVES``): the seconds until the call returned and DCP's staging was done
    (``stall``), until the checkpoint was committed (``commit``), and what the save returned (``info``: a
    ``SaveInfo``, a ``SaveHandle``). ``options``: ``run`` and ``step`` and ``save_async``'s own for rayckpt on
    Ray, ``group`` and ``stager`` for DCP async."""
    t0 = time.perf_counter()
    if system == "rayckpt_ray":
        info = ray_save(state, where, rel, **options)
        stall = time.perf_counter() - t0
        entry = info.wait()
        if entry.status != "committed":
            raise RuntimeError(f"save_async of {rel}: {entry.status}: {entry.error}")
    elif system == "dcp_async":
        info = dcp_async_save(state, where, rel, options.get("group"), options.get("stager"))
        info.staged()
        stall = time.perf_counter() - t0
        info.result()
    elif system == "dcp":
        info = dcp_save(state, where, rel)
    elif system.startswith("rayckpt"):
        info = rayckpt_save(state, where, rel, incremental=system == "rayckpt_incremental", **options)
    else:
        raise ValueError(f"unknown system {system!r}: {', '.join(SAVES)}")
    commit = time.perf_counter() - t0
    return {"stall": stall if system in ("rayckpt_ray", "dcp_async") else commit, "commit": commit, "info": info}


def load(system: str, state: Any, where: Where, rel: str) -> Any:
    """One load by ``system``: rayckpt (its ``LoadInfo``), DCP, or DCP with s3fs's read-ahead off (``dcp_nocache``)."""
    if system.startswith("rayckpt"):
        return rayckpt_load(state, where, rel)
    return dcp_load(state, where, rel, **({"default_cache_type": "none"} if system == "dcp_nocache" else {}))


class BareCopy:
    """The least a checkpoint in memory costs: the rank's local tensors of ``state`` (found once; training
    updates them in place) copied into buffers made and touched beforehand, page-locked when ``pinned``."""

    def __init__(self, state: Any, pinned: bool = False) -> None:
        import torch

        self.pieces = local_tensors(state)
        self.buffers = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pinned).zero_() for p in self.pieces]
        self.pinned = pinned
        self.nbytes = sum(p.numel() * p.element_size() for p in self.pieces)

    def save(self) -> None:
        import torch

        for dst, src in zip(self.buffers, self.pieces):
            dst.copy_(src, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.synchronize()


def memory_tier(state: Any, overlap: bool = True, **options: Any) -> Any:
    """rayckpt's memory tier: a ``Checkpointer`` saving to the nodes' memory every step and never to storage,
    its staging buffers made (``restore`` with nothing to restore, as a run's first restore does)."""
    from rayckpt.train import Checkpointer

    ckpt = Checkpointer(memory_every=1, persist_every=10**9, **({} if overlap else {"overlap": False}), **options)
    ckpt.restore(state)
    return ckpt
