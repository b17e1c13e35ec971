"""Export to and import from one ``torch.save`` file of the full state dict, nested as it was saved.

Exports write torch's own zip layout record by record, so the file is what ``torch.save``
would write and ``torch.load(..., weights_only=True)`` reads it; imports memory-map the file.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import sys
import warnings
from typing import Any

import torch
from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _open_zipfile_writer

from ...engine.state import FlatState, flatten, torch_dtype
from ...errors import CheckpointNotFoundError
from ...format.boxes import row_major_strides
from ...format.manifest import TensorEntry
from ...format.paths import Path, nest
from ...format.values import decode_value
from ..reader import CheckpointReader, Progress
from .common import ConvertInfo, output_path, progress_over, selected
from .streaming import Source


class _StorageRef:
    """A storage whose bytes are written later, under ``key``, by ``export_torch``."""

    def __init__(self, key: str, storage_type: Any, numel: int) -> None:
        self.key, self.storage_type, self.numel = key, storage_type, numel


class _TensorRef:
    """Pickles exactly as ``torch.save`` pickles a contiguous CPU tensor, without its data.

    The rebuild function and trailing arguments come from torch's own reduction of
    an empty tensor of the same dtype, so dtypes that need ``_rebuild_tensor_v3``
    (uint16, float8, ...) are handled the way torch handles them.
    """

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.key, self.dtype, self.shape = key, dtype, shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        rebuild, args = torch.empty(0, dtype=self.dtype).__reduce_ex__(protocol)
        numel = math.prod(self.shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage is deprecated, but it is what torch.save pickles
            if isinstance(args[0], torch.TypedStorage):
                ref = _StorageRef(self.key, getattr(torch, args[0]._pickle_storage_type()), numel)
            else:
                ref = _StorageRef(self.key, torch.UntypedStorage, numel * self.dtype.itemsize)
        return rebuild, (ref, 0, self.shape, row_major_strides(self.shape), *args[4:])


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None


def export_torch(
    reader: CheckpointReader, dst: str, prefix: str, _shard: int, on_progress: Progress | None
) -> ConvertInfo:
    """Write a ``torch.save`` zip file record by record: the pickle first (it needs only
    shapes and dtypes), then each tensor's storage as it is assembled.

    Uses torch's own zip writer (``torch.serialization._open_zipfile_writer``), so the
    file is what ``torch.save`` would write for the same dict.
    """
    keys = selected(reader, prefix)
    leaves: list[tuple[Path, Any]] = []
    tensor_keys: list[str] = []
    for key, _ in keys:
        e = reader.manifest.entries[key]
        if isinstance(e, TensorEntry):
            leaf: Any = _TensorRef(str(len(tensor_keys)), torch_dtype(e.dtype), e.shape)
            tensor_keys.append(key)
        else:
            leaf = decode_value(e.value)
        leaves.append((output_path(reader, key, prefix), leaf))
    stub = nest(leaves)
    data = io.BytesIO()
    _Pickler(data, protocol=DEFAULT_PROTOCOL).dump(stub)
    advance = progress_over(reader, tensor_keys, on_progress)
    total = 0
    with _open_zipfile_writer(dst) as zf:
        for name, record in (
            ("data.pkl", data.getvalue()),
            (".format_version", "1"),
            (".storage_alignment", str(_get_storage_alignment())),
            ("byteorder", sys.byteorder),
        ):
            zf.write_record(name, record, len(record))
        for i, key in enumerate(tensor_keys):
            storage = reader.read_tensor(key).untyped_storage()
            zf.write_record(f"data/{i}", storage, storage.nbytes())
            total += storage.nbytes()
            del storage
            advance(key)
    return ConvertInfo(
        src=reader.ckdir.location,
        dst=dst,
        format="torch",
        direction="to",
        tensors=len(tensor_keys),
        values=len(keys) - len(tensor_keys),
        bytes=total,
        files=(dst,),
    )


def torch_source(src: str) -> Source:
    """A ``torch.save`` file, memory-mapped. Each group of tensors comes from a fresh
    ``torch.load(mmap=True)``, so the pages read are unmapped with the group instead of
    staying resident until the end."""
    if not os.path.isfile(src):
        raise CheckpointNotFoundError(f"{src}: no such file" if not os.path.exists(src) else f"{src} is not a file")

    def load_flat() -> FlatState:
        try:
            sd = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            what = "is not a torch.save file that torch.load(weights_only=True) reads"
            raise ValueError(f"{src} {what}: {first}") from None
        if not isinstance(sd, dict):
            raise ValueError(f"{src} holds a {type(sd).__name__}, not a state dict")
        return flatten(sd)

    flat = load_flat()
    tensors = {k: (t.dtype, t.shape) for k, t in flat.tensors.items()}
    values = {k: v.value for k, v in flat.values.items()}
    paths = flat.paths
    del flat

    def load(keys: list[str]) -> dict[str, torch.Tensor]:
        leaves = load_flat().tensors
        return {k: leaves[k].pieces[0].local for k in keys}  # plain tensors: one piece, the whole

    return Source(format="torch", tensors=tensors, values=values, load=load, paths=paths)
