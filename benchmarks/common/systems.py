"""The systems every benchmark measures, each behind one adapter: rayckpt, rayckpt on Ray, its memory
tier, DCP, DCP async, DCP's API on rayckpt's writer and reader, ``torch.save`` and a bare copy; a
checkpoint's place (``Where``) is a local directory or a prefix on an S3 endpoint, the same calls for
both. ``save`` and ``load`` run any of them by name."""

from __future__ import annotations

import itertools
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common.diskio import files_under


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
        path = os.path.join(self.root, rel)
        if self.endpoint or not os.path.exists(path):
            return []
        return files_under(path) if os.path.isdir(path) else [path]

    def dcp(self, rel: str, writer: bool, rayckpt: bool = False, **options: Any) -> Any:
        """DCP's storage writer or reader of ``rel`` (``rayckpt``: rayckpt's); on an endpoint over s3fs, a fresh
        instance each time (no listing cache carried over, as in a new process), ``options`` its own."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        if rayckpt:
            import rayckpt.dcp as ours

            return (ours.StorageWriter if writer else ours.StorageReader)(self.uri(rel))
        if not self.endpoint:
            return (dcp.FileSystemWriter if writer else dcp.FileSystemReader)(os.path.join(self.root, rel))
        s3fs = {"endpoint_url": f"http://{self.endpoint.host_port}", "skip_instance_cache": True, **options}
        return (FsspecWriter if writer else FsspecReader)(f"s3://{self.endpoint.fs_path(rel)}", **s3fs)


def local(path: str) -> tuple[Where, str]:
    """A local path as (``Where``, rel): for the benchmarks that name one directory."""
    return Where(os.path.dirname(path) or "."), os.path.basename(path)


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


def release_staging() -> None:
    from rayckpt.ray import release_staging as release

    release()


def dcp_stager(options: tuple[bool, bool, bool, bool] | None) -> Any:
    """A ``DefaultStager`` with ``StagingOptions(*options)`` (pinned, shared, async staging, non-blocking)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(*options)) if options is not None else None


def dcp_async_save(state: Any, where: Where, rel: str, group: Any = None, stager: Any = None) -> tuple[Any, Any]:
    """``dcp.async_save`` (its own gloo ``group``, as DCP's docs ask; a reused ``stager``): its upload's future,
    and what waits for its staging where the stager runs it apart."""
    import torch.distributed.checkpoint as dcp

    kwargs = {"async_stager": stager} if stager is not None else {}
    response = dcp.async_save(state, storage_writer=where.dcp(rel, writer=True), process_group=group, **kwargs)
    staging = getattr(response, "staging_completion", None)
    return getattr(response, "upload_completion", response), staging.result if staging is not None else lambda: None


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
SAVES = ("rayckpt", "rayckpt_incremental", "rayckpt_ray", "dcp", "dcp_async", "dcp_rayckpt")


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
        info, staged = dcp_async_save(state, where, rel, options.get("group"), options.get("stager"))
        staged()
        stall = time.perf_counter() - t0
        info.result()
    elif system in ("dcp", "dcp_rayckpt"):
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=where.dcp(rel, writer=True, rayckpt=system == "dcp_rayckpt"))
        info = None  # DCP returns its metadata, no report of the save
    elif system.startswith("rayckpt"):
        import rayckpt

        info = rayckpt.save(state, where.uri(rel), incremental=system == "rayckpt_incremental", **options)
    else:
        raise ValueError(f"unknown system {system!r}: {', '.join(SAVES)}")
    commit = time.perf_counter() - t0
    return {"stall": stall if system in ("rayckpt_ray", "dcp_async") else commit, "commit": commit, "info": info}


def load(system: str, state: Any, where: Where, rel: str) -> Any:
    """One load by ``system`` (``dcp_nocache``: s3fs's read-ahead off): a rayckpt reader's ``LoadInfo`` or None."""
    import torch.distributed.checkpoint as dcp

    import rayckpt

    if system.startswith("rayckpt"):
        return rayckpt.load(state, where.uri(rel))
    options = {"default_cache_type": "none"} if system == "dcp_nocache" else {}
    reader = where.dcp(rel, writer=False, rayckpt=system.startswith("dcp_rayckpt"), **options)
    dcp.load(state, storage_reader=reader)
    return getattr(reader, "last_load", None)


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

    ckpt = Checkpointer(memory_every=1, persist_every=10**9, overlap=overlap, **options)
    ckpt.restore(state)
    return ckpt


#: The modes ``Modes`` saves in: the stager options (pinned, shared, async staging, non-blocking) of DCP's
#: ``async_save``, the ``overlap`` of rayckpt's ``save_async`` and of its memory tier.
MODES: dict[str, Any] = {"none": None, "copy": None, "dcp": (True, False, False, False)}
MODES |= {"dcp-async-staging": (True, True, True, True), "rayckpt-sync": False, "rayckpt": True, "rayckpt-all": "all"}
MODES |= {"memory": True, "memory-sync": False, "rayckpt-data": True}


class Modes:
    """Saves beside a training loop, by mode (of ``MODES``): what each needs made beforehand (buffers, reused
    stagers, staging buffers, memory tiers), ``save`` starting one (the call a step pays), ``before_step``
    waiting for DCP's staging before the optimizer step (rayckpt's guarded optimizer waits for its own copy),
    ``finish`` waiting for the save in flight and removing it, ``settle`` waiting for every background save."""

    def __init__(self, state: Any, modes: tuple[str, ...], root: str, *, cuda: bool = False, **options: Any) -> None:
        import torch.distributed as dist

        self.state, self.root, self.cuda = state, root, cuda
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        #: ``run``, ``step``: of rayckpt's saves; ``group``: DCP's upload's own gloo group; ``local_is_shared``.
        self.options = options
        #: Modes that could not be made, with their error.
        self.failed: dict[str, str] = {}
        self.copy = BareCopy(state, pinned=cuda) if "copy" in modes else None
        shared = options.get("local_is_shared")
        # Made before any save: a Checkpointer made later would count as a restarted worker group.
        self.memory = {m: memory_tier(state, MODES[m], local_is_shared=shared) for m in modes if m.startswith("memory")}
        self.stagers = {}
        for mode in (m for m in modes if m.startswith("dcp")):
            try:
                self.stagers[mode] = dcp_stager(MODES[mode])
            except Exception as exc:  # a stager this torch cannot run is a result, not a crash
                self.failed[mode] = f"{type(exc).__name__}: {exc}"[:400]
        self.ray = any(m.startswith("rayckpt") for m in modes)
        from rayckpt.data import ResumableSampler

        self.data = ResumableSampler(10**6, seed=1, identity="bench")  # rayckpt-data's, 1000 into its epoch
        list(itertools.islice(iter(self.data), 1000))
        if self.ray:
            prepare_staging(state, wait=True)
        self.staging: Any = None
        self.pending: tuple[str, Any] | None = None

    def save(self, mode: str, step: int) -> bool | None:
        """Start ``step``'s save in ``mode``, the one before finished first (as torchtitan waits for DCP's
        upload); for the memory tier, whether it skipped the save."""
        self.finish()
        path = os.path.join(self.root, f"{mode}-{step}")
        if mode == "copy":
            self.copy.save()
        elif mode.startswith("dcp"):
            upload, self.staging = dcp_async_save(
                self.state, *local(path), self.options.get("group"), self.stagers[mode]
            )
            self.pending = (path, upload.result)
        elif mode.startswith("rayckpt"):
            run = self.options.get("run", "bench")
            data = {"data": self.data} if mode == "rayckpt-data" else {}
            handle = ray_save(self.state, *local(path), run=run, step=step, overlap=MODES[mode], **data)
            self.pending = (path, lambda: self._committed(handle, step))
        elif mode in self.memory:
            before = self.memory[mode].memory_skipped
            self.memory[mode].save(step, self.state, persist=False)
            return self.memory[mode].memory_skipped > before
        return None

    def _committed(self, handle: Any, step: int) -> dict[str, Any]:
        entry = handle.wait()
        if entry.status != "committed":
            raise RuntimeError(f"save_async of step {step}: {entry.status}: {entry.error}")
        return {"late_bytes": handle.late_bytes, "copy_s": handle.copy_seconds}

    def before_step(self) -> None:
        if self.staging is not None:
            self.staging, staged = None, self.staging
            staged()

    def finish(self) -> dict[str, Any]:
        """Wait for the save in flight (done: every rank's files written) and remove it (rank 0); its figures."""
        self.before_step()
        if self.pending is None:
            return {}
        (path, wait), self.pending = self.pending, None
        done = wait()
        done = done if isinstance(done, dict) else {}
        if self.rank == 0:
            done["ckpt_bytes"] = sum(map(os.path.getsize, files_under(path))) if os.path.isdir(path) else 0
            shutil.rmtree(path, ignore_errors=True)
        return done

    def settle(self) -> None:
        """Every save's background work done (untimed)."""
        self.finish()
        for ckpt in self.memory.values():
            ckpt.wait()

    def close(self) -> None:
        for stager in self.stagers.values():
            stager.close()
        for ckpt in self.memory.values():
            ckpt.release_memory()
        if self.ray:
            release_staging()
