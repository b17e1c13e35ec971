"""Export to and import from a ``torch.distributed.checkpoint`` (DCP) directory.

Both directions go through DCP itself (``dcp.save`` / ``dcp.load`` with ``no_dist=True``),
so the layout is what ``FileSystemWriter`` writes and ``format_utils`` reads; imports
also take checkpoints saved by many FSDP ranks, and regroup DCP's per-leaf plain values
into the containers rayckpt stores as one value (``regroup_values``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ...engine.state import dtype_name, torch_dtype
from ...errors import CheckpointNotFoundError, CorruptCheckpointError, RayckptError
from ...format.manifest import TensorEntry
from ...format.paths import Path, join_path, nest
from ...format.values import decode_value
from ..reader import CheckpointReader, Progress
from .common import ConvertInfo, output_path, progress_over, selected
from .streaming import Source


@contextlib.contextmanager
def _dcp_errors(what: str) -> Iterator[None]:
    """DCP wraps every failure in a ``CheckpointException`` (a ``BaseException``): unwrap it."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            yield
    except CheckpointException as exc:
        errors = [pair[0] for pair in exc.failures.values()]
        if errors and isinstance(errors[0], (RayckptError, OSError)):
            raise errors[0] from None
        detail = f"{type(errors[0]).__name__}: {errors[0]}" if errors else str(exc)
        raise RayckptError(f"{what} failed: {detail}") from None


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans a DCP save from meta tensors; each tensor's data is assembled only when
    the storage writer asks for it (``resolve_data``) and dropped after it is written."""

    def __init__(self, reader: CheckpointReader, keys: dict[str, str], advance: Callable[[str], None]) -> None:
        super().__init__()
        self._reader = reader
        self._keys = keys
        self._advance = advance
        self.bytes = 0

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        key = self._keys[write_item.index.fqn]
        tensor = self._reader.read_tensor(key)
        self.bytes += tensor.nbytes
        self._advance(key)
        return tensor


def export_dcp(
    reader: CheckpointReader, dst: str, prefix: str, _shard: int, on_progress: Progress | None
) -> ConvertInfo:
    """A DCP checkpoint, one ``.distcp`` file per tensor (so the writer holds one at a
    time), written by ``dcp.save`` itself from the state dict nested as it was saved,
    so DCP records each key's own path (``planner_data``)."""
    keys = selected(reader, prefix)
    leaves: list[tuple[Path, Any]] = []
    tensors: dict[str, str] = {}  # DCP's key -> rayckpt's
    for key, _ in keys:
        e = reader.manifest.entries[key]
        path = output_path(reader, key, prefix)
        if isinstance(e, TensorEntry):
            leaves.append((path, torch.empty(e.shape, dtype=torch_dtype(e.dtype), device="meta")))
            tensors[join_path(path)] = key
        else:
            leaves.append((path, decode_value(e.value)))
    state = nest(leaves)
    planner = _StreamingSavePlanner(reader, tensors, progress_over(reader, tensors.values(), on_progress))
    writer = FileSystemWriter(dst, single_file_per_rank=False, thread_count=1)
    with _dcp_errors("DCP save"):
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    files = tuple(sorted(os.listdir(dst)))
    num_values = len(keys) - len(tensors)
    return ConvertInfo(
        src=reader.ckdir.location,
        dst=dst,
        format="dcp",
        direction="to",
        tensors=len(tensors),
        values=num_values,
        bytes=planner.bytes,
        files=files,
    )


def dcp_source(src: str) -> Source:
    """A DCP directory: metadata first, then whole tensors with ``dcp.load`` in no-process-group mode.

    DCP stores plain values pickled, one per leaf; they are regrouped into the
    containers rayckpt stores as one value (``app.optim.param_groups``) using the
    object paths DCP keeps in its metadata. DCP metadata and values are pickles:
    import only DCP checkpoints you trust.
    """
    if not os.path.isdir(src):
        raise CheckpointNotFoundError(
            f"{src}: no such directory" if not os.path.exists(src) else f"{src} is not a directory"
        )
    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise CheckpointNotFoundError(f"{src} is not a torch.distributed.checkpoint directory (no .metadata)")
    try:
        metadata = FileSystemReader(src).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as exc:
        raise CorruptCheckpointError(f"{src}/.metadata is not readable DCP metadata: {exc}") from None
    tensors = {}
    byte_keys = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = (dtype_name(md.properties.dtype), tuple(md.size))
        else:
            byte_keys.append(fqn)

    def load(keys: list[str]) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for k in keys:
            if k in tensors:
                dtype, shape = tensors[k]
                state[k] = torch.empty(shape, dtype=torch_dtype(dtype))
            else:
                state[k] = None
        with _dcp_errors(f"reading {src} with dcp.load"):
            dcp.load(state, storage_reader=FileSystemReader(src), no_dist=True)
        return state

    paths = _object_paths(metadata.planner_data)
    values, value_paths = regroup_values(load(byte_keys) if byte_keys else {}, paths, tensors)
    return Source(
        format="dcp",
        tensors=tensors,
        values=values,
        load=load,
        paths={**{k: paths[k] for k in tensors if k in paths}, **value_paths},
    )


def _object_paths(planner_data: Any) -> dict[str, Path]:
    """DCP's recorded object path of each key (``planner_data``), where it is a well-formed one."""
    if not isinstance(planner_data, dict):
        return {}
    out: dict[str, Path] = {}
    for fqn, path in planner_data.items():
        path = tuple(path) if isinstance(path, (tuple, list)) else ()
        if path and all(isinstance(p, str) or type(p) is int for p in path) and join_path(path) == fqn:
            out[fqn] = path
    return out


def regroup_values(
    values: dict[str, Any], paths: dict[str, Path], tensor_keys: Iterable[str]
) -> tuple[dict[str, Any], dict[str, Path]]:
    """DCP keeps one entry per leaf; rayckpt keeps each container that holds no tensor as one value.

    ``paths`` maps a DCP key to its object path (``("app", "optim", "param_groups", 0, "lr")``);
    a value goes under the shortest path prefix that holds no tensor, and list
    indices rebuild lists. Keys without a path stay as they are. Returns the
    values by rayckpt key, and the path of each that has one.
    """
    holders = {paths[k][:i] for k in tensor_keys if k in paths for i in range(1, len(paths[k]))}
    out: dict[str, Any] = {}
    out_paths: dict[str, Path] = {}
    nested: dict[str, dict[Any, Any]] = {}
    for fqn, value in values.items():
        path = paths.get(fqn)
        if path is None:
            out[fqn] = value
            continue
        cut = 1
        while cut < len(path) and path[:cut] in holders:
            cut += 1
        key = join_path(path[:cut])
        out_paths[key] = path[:cut]
        rest = path[cut:]
        if not rest:
            out[key] = value
            continue
        node = nested.setdefault(key, {})
        for part in rest[:-1]:
            node = node.setdefault(part, {})
        node[rest[-1]] = value
    for key, tree in nested.items():
        out[key] = _lists_from_indices(tree)
    return out, out_paths


def _lists_from_indices(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {k: _lists_from_indices(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items):
        return [items.get(i) for i in range(max(items) + 1)]
    return items
