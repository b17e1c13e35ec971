"""Move checkpoints between rayckpt and the formats the rest of the ecosystem reads.

- ``torch``: one ``torch.save`` file of the full state dict (flattened keys),
  loadable with ``torch.load(..., weights_only=True)``.
- ``dcp``: a ``torch.distributed.checkpoint`` directory (``FileSystemWriter``
  layout) that ``dcp.load`` and ``format_utils`` read; and back, including
  checkpoints saved by many FSDP ranks.
- ``safetensors``: tensors as safetensors files, split with a Hugging Face style
  ``model.safetensors.index.json`` when larger than ``max_shard_bytes``.

Everything streams tensor by tensor (imports: in groups of at most
``group_bytes``), so one process holds about the largest tensor, never the
whole model. Imports write a normal rayckpt checkpoint with the engine's own
shard writer and commit.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import shutil
import struct
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ...engine.state import FlatState, as_bytes, dtype_name, flatten, torch_dtype
from ...engine.writer import write_chunks
from ...errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidStateError, RayckptError
from ...format.boxes import Box, row_major_strides
from ...format.manifest import TensorEntry, decode_value, encode_value, itemsize
from ...format.shard_file import DEFAULT_BLOCK_SIZE, ChunkData, storage_type
from ...planning.save_plan import LocalShard, create_save_plans
from ...storage.checkpoint_dir import CheckpointDir
from ...storage.commit import SaveSpec, commit_save, new_save_id, remove_failed_save
from ..reader import CheckpointReader, Progress, tensor_nbytes

FORMATS = ("torch", "dcp", "safetensors")
#: Hugging Face's default shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: Imports load source tensors in groups of at most this many bytes (a larger tensor alone).
DEFAULT_GROUP_BYTES = 64 * 2**20

SAFETENSORS_INDEX = "model.safetensors.index.json"
#: rayckpt dtype name -> safetensors dtype name.
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "complex64": "C64",
}


@dataclass(frozen=True, slots=True)
class ConvertInfo:
    src: str
    dst: str
    #: The other format: what was written (``direction="to"``) or read (``"from"``).
    format: str
    direction: str
    tensors: int
    values: int
    #: Tensor payload bytes converted.
    bytes: int
    #: Files written, relative to ``dst`` (``dst`` itself for a torch file).
    files: tuple[str, ...]


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    from_: str | None = None,
    prefix: str = "",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    block_size: int = DEFAULT_BLOCK_SIZE,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    on_progress: Progress | None = None,
) -> ConvertInfo:
    """Convert between rayckpt and another format, in this process.

    ``to=FORMAT`` exports the rayckpt checkpoint ``src`` to ``dst``; ``from_=FORMAT``
    imports ``src`` (in that format) as a new rayckpt checkpoint at ``dst``, saved by
    one rank and loadable by any world size. Exactly one of the two.

    ``prefix``: exports keep only keys starting with it and strip it (``"app.model."``
    gives a plain model state dict); imports prepend it to every key. ``dst`` must
    not exist yet (an empty directory is fine).
    """
    if (to is None) == (from_ is None):
        raise ValueError("give exactly one of --to FORMAT (export) or --from FORMAT (import)")
    fmt = to if to is not None else from_
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if max_shard_bytes <= 0 or group_bytes <= 0:
        raise ValueError("max_shard_bytes and group_bytes must be positive")
    src, dst = os.fspath(src), os.fspath(dst)
    out = CheckpointDir.resolve(dst)
    if to is not None and not out.is_local:
        raise ValueError(f"--to {to} writes to a local path, not {dst}")
    kind = out.fs.get_file_info(out.root).type
    if kind != pafs.FileType.NotFound and (kind != pafs.FileType.Directory or out.list_files() or out.list_dirs()):
        raise ValueError(f"destination {out.uri} already exists; remove it or choose a new path")
    if to is not None:
        export = {"torch": _export_torch, "dcp": _export_dcp, "safetensors": _export_safetensors}[to]
        reader = CheckpointReader(src)
        try:
            return export(reader, out.root, prefix, max_shard_bytes, on_progress)
        except BaseException:
            _remove_output(out.root, keep_dir=kind == pafs.FileType.Directory)
            raise
    source = {"torch": _torch_source, "dcp": _dcp_source, "safetensors": _safetensors_source}[fmt](src)
    return _import(source, out, src, prefix, block_size, group_bytes, on_progress)


def _remove_output(path: str, keep_dir: bool) -> None:
    """Remove what a failed export wrote (the directory too, unless it was there before)."""
    if os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        if keep_dir:
            for name in os.listdir(path):
                _remove_output(os.path.join(path, name), keep_dir=False)
        else:
            shutil.rmtree(path, ignore_errors=True)


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


def _selected(reader: CheckpointReader, prefix: str) -> list[tuple[str, str]]:
    """(key in the checkpoint, key in the output) for every entry under ``prefix``."""
    keys = [(k, k[len(prefix) :]) for k in reader.manifest.entries if k.startswith(prefix)]
    if not keys:
        raise ValueError(f"no key in {reader.ckdir.uri} starts with prefix {prefix!r}")
    return keys


def _progress_over(
    reader: CheckpointReader, keys: Iterable[str], on_progress: Progress | None
) -> Callable[[str], None]:
    """A callback to call after each tensor key is written, reporting bytes done."""
    nbytes = {k: tensor_nbytes(reader.manifest.tensor(k)) for k in keys}
    total = sum(nbytes.values())
    done = 0

    def advance(key: str) -> None:
        nonlocal done
        done += nbytes[key]
        if on_progress:
            on_progress(done, total)

    return advance


# ---------------------------------------------------------------------------
# Export: torch.save


class _StorageRef:
    """A storage whose bytes are written later, under ``key``, by ``_export_torch``."""

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


def _export_torch(
    reader: CheckpointReader, dst: str, prefix: str, _shard: int, on_progress: Progress | None
) -> ConvertInfo:
    """Write a ``torch.save`` zip file record by record: the pickle first (it needs only
    shapes and dtypes), then each tensor's storage as it is assembled.

    Uses torch's own zip writer (``torch.serialization._open_zipfile_writer``), so the
    file is what ``torch.save`` would write for the same dict.
    """
    from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _open_zipfile_writer

    keys = _selected(reader, prefix)
    stub: dict[str, Any] = {}
    tensor_keys: list[str] = []
    for key, out_key in keys:
        e = reader.manifest.entries[key]
        if isinstance(e, TensorEntry):
            stub[out_key] = _TensorRef(str(len(tensor_keys)), torch_dtype(e.dtype), e.shape)
            tensor_keys.append(key)
        else:
            stub[out_key] = decode_value(e.value)
    data = io.BytesIO()
    _Pickler(data, protocol=DEFAULT_PROTOCOL).dump(stub)
    advance = _progress_over(reader, tensor_keys, on_progress)
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
        reader.ckdir.uri, dst, "torch", "to", len(tensor_keys), len(keys) - len(tensor_keys), total, (dst,)
    )


# ---------------------------------------------------------------------------
# Export: DCP


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


def _export_dcp(
    reader: CheckpointReader, dst: str, prefix: str, _shard: int, on_progress: Progress | None
) -> ConvertInfo:
    """A DCP checkpoint, one ``.distcp`` file per tensor (so the writer holds one at a
    time), written by ``dcp.save`` itself from a flat dict of dotted keys."""
    keys = _selected(reader, prefix)
    state: dict[str, Any] = {}
    tensors: dict[str, str] = {}
    for key, out_key in keys:
        e = reader.manifest.entries[key]
        if isinstance(e, TensorEntry):
            state[out_key] = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device="meta")
            tensors[out_key] = key
        else:
            state[out_key] = decode_value(e.value)
    planner = _StreamingSavePlanner(reader, tensors, _progress_over(reader, tensors.values(), on_progress))
    writer = FileSystemWriter(dst, single_file_per_rank=False, thread_count=1)
    with _dcp_errors("DCP save"):
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    files = tuple(sorted(os.listdir(dst)))
    return ConvertInfo(reader.ckdir.uri, dst, "dcp", "to", len(tensors), len(keys) - len(tensors), planner.bytes, files)


# ---------------------------------------------------------------------------
# Export: safetensors


def _export_safetensors(
    reader: CheckpointReader, dst: str, prefix: str, max_shard_bytes: int, on_progress: Progress | None
) -> ConvertInfo:
    """Tensors (plain values have no place in safetensors) into files of at most
    ``max_shard_bytes`` in the directory ``dst`` (or the one file ``dst`` when it ends
    in ``.safetensors``), written by hand from the manifest's shapes so each file
    streams one tensor at a time."""
    tensors = [
        (k, out, e) for k, out in _selected(reader, prefix) if isinstance(e := reader.manifest.entries[k], TensorEntry)
    ]
    if not tensors:
        raise ValueError(f"no tensor under prefix {prefix!r} in {reader.ckdir.uri}")
    shards: list[list[tuple[str, str, TensorEntry]]] = [[]]
    size = 0
    for item in tensors:
        if item[2].dtype not in SAFETENSORS_DTYPES:
            raise InvalidStateError(f"key {item[1]!r}: safetensors has no dtype {item[2].dtype}")
        nbytes = tensor_nbytes(item[2])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    directory = dst
    if dst.endswith(".safetensors"):  # one file, named by the caller
        if len(shards) > 1:
            raise ValueError(
                f"the tensors need {len(shards)} files of at most {max_shard_bytes} bytes; give a directory as "
                "DST (or a larger --max-shard-size) to write them with an index"
            )
        directory, names = os.path.dirname(dst), [os.path.basename(dst)]
    elif len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    advance = _progress_over(reader, [k for k, _, _ in tensors], on_progress)
    os.makedirs(directory, exist_ok=True)
    total = 0
    for name, shard in zip(names, shards):
        header: dict[str, Any] = {}
        offset = 0
        for _, out_key, e in shard:
            nbytes = tensor_nbytes(e)
            header[out_key] = {
                "dtype": SAFETENSORS_DTYPES[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        with open(os.path.join(directory, name), "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for key, _, _ in shard:
                f.write(as_bytes(reader.read_tensor(key)))
                advance(key)
        total += offset
    if len(shards) > 1:
        weight_map = {out_key: name for name, shard in zip(names, shards) for _, out_key, _ in shard}
        with open(os.path.join(directory, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        names.append(SAFETENSORS_INDEX)
    skipped = len(_selected(reader, prefix)) - len(tensors)
    files = (dst,) if dst.endswith(".safetensors") else tuple(names)
    return ConvertInfo(reader.ckdir.uri, dst, "safetensors", "to", len(tensors), skipped, total, files)


# ---------------------------------------------------------------------------
# Import


@dataclass(frozen=True, slots=True)
class _Source:
    """A checkpoint in another format, seen as flat keys."""

    format: str
    #: key -> (rayckpt dtype name, global shape)
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    #: key -> plain Python value
    values: dict[str, Any]
    #: Loads whole tensors for the given keys (a bounded group) into memory.
    load: Callable[[list[str]], dict[str, torch.Tensor]]


class _LazyChunk(ChunkData):
    """A chunk whose bytes are fetched only when the shard file writer reaches it.

    The engine's writer reads ``data`` once, just before writing the chunk, so
    passing these to ``write_chunks`` streams a whole import through it.
    """

    __slots__ = ("_fetch",)

    def __init__(self, key: str, dtype: str, box: Box, fetch: Callable[[str, Box], Any]) -> None:
        for name, value in (("key", key), ("dtype", dtype), ("box", box), ("_fetch", fetch)):
            object.__setattr__(self, name, value)

    @property
    def data(self) -> Any:  # type: ignore[override]
        return self._fetch(self.key, self.box)


class _TensorStream:
    """Hands the writer each chunk's bytes, loading tensors in bounded groups in the
    order the writer asks for them and dropping each group before loading the next."""

    def __init__(
        self,
        nbytes: dict[str, int],
        load: Callable[[list[str]], dict[str, torch.Tensor]],
        order: list[str],
        group_bytes: int,
        on_progress: Progress | None,
    ) -> None:
        self._nbytes = nbytes
        self._load = load
        self._order = order
        self._pos = {k: i for i, k in enumerate(order)}
        self._group_bytes = group_bytes
        self._on_progress = on_progress
        self._total = sum(nbytes.values())
        self._done = 0
        self._cache: dict[str, torch.Tensor] = {}

    def __call__(self, key: str, box: Box) -> Any:
        if key not in self._cache:
            group: list[str] = []
            size = 0
            for k in self._order[self._pos[key] :]:
                if group and size + self._nbytes[k] > self._group_bytes:
                    break
                group.append(k)
                size += self._nbytes[k]
            self._cache = {}
            self._cache = self._load(group)
            self._done += size
            if self._on_progress:
                self._on_progress(self._done, self._total)
        return as_bytes(self._cache[key][box.to_slices()].contiguous())


def _import(
    source: _Source,
    out: CheckpointDir,
    src: str,
    prefix: str,
    block_size: int,
    group_bytes: int,
    on_progress: Progress | None,
) -> ConvertInfo:
    """Write ``source`` as a rayckpt checkpoint saved by one rank, then commit it."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tensors = {prefix + k: v for k, v in source.tensors.items()}
    values = {prefix + k: encode_value(v, prefix + k) for k, v in source.values.items()}
    nbytes = {k: itemsize(dtype) * math.prod(shape) for k, (dtype, shape) in tensors.items()}
    both = sorted(set(tensors) & set(values))
    if both:
        raise InvalidStateError(f"key {both[0]!r} is both a tensor and a value in {src}")

    def load(keys: list[str]) -> dict[str, torch.Tensor]:
        loaded = source.load([k[len(prefix) :] for k in keys])
        return {prefix + k: t for k, t in loaded.items()}

    plan = create_save_plans([[LocalShard(k, d, s, Box.full(s)) for k, (d, s) in tensors.items()]])[0]
    # write_chunks writes one file per storage type, in sorted type order: load in that order.
    order = list(dict.fromkeys(i.key for i in sorted(plan.items, key=lambda i: storage_type(tensors[i.key][0]))))
    stream = _TensorStream(nbytes, load, order, group_bytes, on_progress)
    chunks = [_LazyChunk(i.key, tensors[i.key][0], i.box, stream) for i in plan.items]
    metadata = {"converted_from": {"format": source.format, "path": src}}
    spec = SaveSpec(new_save_id(), 1, block_size, tensors, values, metadata)
    written_files: list[str] = []
    try:
        shard = write_chunks(out, chunks, spec.save_id, 0, block_size, written_files)
        commit_save(out, spec, [shard])
    except BaseException:
        remove_failed_save(out, spec.save_id, written_files)
        raise
    paths = tuple(f.path for f in shard.files)
    return ConvertInfo(src, out.uri, source.format, "from", len(tensors), len(values), sum(nbytes.values()), paths)


def _torch_source(src: str) -> _Source:
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
    del flat

    def load(keys: list[str]) -> dict[str, torch.Tensor]:
        leaves = load_flat().tensors
        return {k: leaves[k].local for k in keys}

    return _Source("torch", tensors, values, load)


def _dcp_source(src: str) -> _Source:
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

    paths = dict(metadata.planner_data or {}) if isinstance(metadata.planner_data, dict) else {}
    flat_values = load(byte_keys) if byte_keys else {}
    return _Source("dcp", tensors, regroup_values(flat_values, paths, tensors), load)


def regroup_values(
    values: dict[str, Any], paths: dict[str, tuple[Any, ...]], tensor_keys: Iterable[str]
) -> dict[str, Any]:
    """DCP keeps one entry per leaf; rayckpt keeps each container that holds no tensor as one value.

    ``paths`` maps a DCP key to its object path (``("app", "optim", "param_groups", 0, "lr")``);
    a value goes under the shortest path prefix that holds no tensor, and list
    indices rebuild lists. Keys without a path stay as they are.
    """
    holders = {paths[k][:i] for k in tensor_keys if k in paths for i in range(1, len(paths[k]))}
    out: dict[str, Any] = {}
    nested: dict[str, dict[Any, Any]] = {}
    for fqn, value in values.items():
        path = tuple(paths.get(fqn, (fqn,)))
        cut = 1
        while cut < len(path) and path[:cut] in holders:
            cut += 1
        key = ".".join(map(str, path[:cut]))
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
    return out


def _lists_from_indices(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {k: _lists_from_indices(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items):
        return [items.get(i) for i in range(max(items) + 1)]
    return items


def _safetensors_source(src: str) -> _Source:
    """A safetensors file, or a directory of them (with or without an index)."""
    from safetensors import safe_open

    if os.path.isdir(src):
        index = os.path.join(src, SAFETENSORS_INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                names = list(dict.fromkeys(json.load(f)["weight_map"].values()))
        else:
            names = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
        files = [os.path.join(src, n) for n in names]
        if not files:
            raise CheckpointNotFoundError(f"{src} holds no .safetensors file")
    elif os.path.isfile(src):
        files = [src]
    else:
        raise CheckpointNotFoundError(f"{src}: no such file or directory")
    dtypes = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    tensors = {}
    owner = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as handle:
                for k in handle.keys():
                    sl = handle.get_slice(k)
                    tensors[k] = (dtypes.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape()))
                    owner[k] = path
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"{path} is not a safetensors file: {exc}") from None

    def load(keys: list[str]) -> dict[str, torch.Tensor]:
        # Opened per group, so the memory map of what was read goes away with it.
        out = {}
        for path in dict.fromkeys(owner[k] for k in keys):
            with safe_open(path, framework="pt") as handle:
                out.update({k: handle.get_tensor(k) for k in keys if owner[k] == path})
        return out

    return _Source("safetensors", tensors, {}, load)
