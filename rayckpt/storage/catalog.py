"""Finding checkpoints in storage: the catalog entries ``rayckpt ls`` and the MetadataActor share.

Ray-free. A run directory holds checkpoint directories (``rayckpt-step-<step>``
when written by the Ray Train ``Checkpointer``); a directory is a committed
checkpoint when it has a valid manifest, "incomplete" when it has shard files
but no manifest (a save that crashed), "corrupt" when its manifest is unreadable.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import RayckptError
from ..format.file_paths import written_bytes
from ..format.manifest import MANIFEST_NAME
from .checkpoint_dir import CheckpointDir
from .commit import read_manifest

CHECKPOINT_PREFIX = "rayckpt-step-"
_STEP_DIR = re.compile(rf"{CHECKPOINT_PREFIX}(\d+)$")


def checkpoint_dir_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_step(path: str) -> int | None:
    """The step in a checkpoint directory's name (``rayckpt-step-<step>``), or ``None``."""
    match = _STEP_DIR.search(path.rstrip("/"))
    return int(match.group(1)) if match else None


@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogEntry:
    """One checkpoint: found in storage or tracked by the MetadataActor."""

    run: str
    step: int | None
    #: The checkpoint's location as given (it reopens it); may carry credentials: show ``redact(path)``.
    path: str
    #: "committed", "pending" (a save in flight), "failed" (rolled back),
    #: "incomplete" (shard files, no manifest) or "corrupt" (unreadable manifest).
    status: str
    created: float
    world_size: int
    #: Bytes of the shard files the save wrote (an incremental save's shared files not counted).
    bytes: int
    save_id: str
    error: str | None = None


def looks_like_checkpoint(ckdir: CheckpointDir) -> bool:
    """Whether ``ckdir`` holds a manifest or shard files (one the OS will not list: yes, ``describe`` says why)."""
    try:
        files = ckdir.list_files()
    except OSError:
        return True
    return MANIFEST_NAME in files or any(f.endswith(".arrow") for f in files)


def describe(ckdir: CheckpointDir, run: str) -> CatalogEntry | None:
    """The catalog entry of one directory, or ``None`` when it holds no checkpoint.

    Never raises for what is in the directory: a manifest that cannot be read or
    is invalid (every such problem is a ``RayckptError``), or a directory or
    file the OS will not read (``OSError``), makes a "corrupt" entry with the
    reason, so one damaged checkpoint leaves the rest of the run usable.
    """
    step = checkpoint_step(ckdir.fs_path)
    try:
        return _describe(ckdir, run, step)
    except (RayckptError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return CatalogEntry(
            run=run,
            step=step,
            path=ckdir.uri,
            status="corrupt",
            created=0.0,
            world_size=0,
            bytes=0,
            save_id="",
            error=reason,
        )


def _describe(ckdir: CheckpointDir, run: str, step: int | None) -> CatalogEntry | None:
    files = ckdir.list_files()
    if MANIFEST_NAME in files:
        m = read_manifest(ckdir)
        meta_step = m.user_metadata.get("step")
        return CatalogEntry(
            run=str(m.user_metadata.get("run") or run),
            step=meta_step if isinstance(meta_step, int) else step,
            path=ckdir.uri,
            status="committed",
            created=m.created,
            world_size=m.world_size,
            bytes=written_bytes(m.save_id, m.files),
            save_id=m.save_id,
        )
    arrow = [f for f in files if f.endswith(".arrow")]
    if arrow:
        size = sum(ckdir.size(f) or 0 for f in arrow)
        return CatalogEntry(
            run=run, step=step, path=ckdir.uri, status="incomplete", created=0.0, world_size=0, bytes=size, save_id=""
        )
    return None


def scan_run(run_dir: CheckpointDir, run: str) -> list[CatalogEntry]:
    """Every checkpoint directly under ``run_dir``, oldest step first."""
    found = [e for name in run_dir.list_dirs() if (e := describe(run_dir.child(name), run)) is not None]
    return sorted(found, key=entry_order)


def latest_committed(entries: Iterable[CatalogEntry]) -> CatalogEntry | None:
    """The newest committed entry (by ``entry_order``); corrupt, incomplete and pending ones are passed over."""
    committed = sorted((e for e in entries if e.status == "committed"), key=entry_order)
    return committed[-1] if committed else None


def entry_order(e: CatalogEntry) -> tuple:
    return (e.step is not None, e.step or 0, e.created, e.path)
