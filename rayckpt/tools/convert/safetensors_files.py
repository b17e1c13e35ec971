"""Export to and import from safetensors: one file, or a directory of them with a Hugging Face
style ``model.safetensors.index.json`` when the tensors need more than one file.

Exports write the files by hand from the manifest's shapes (safetensors holds tensors only,
so plain values are skipped); imports read one file or a directory, with or without an index.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import torch
from safetensors import safe_open

from ...engine.state import as_bytes
from ...errors import CheckpointNotFoundError, InvalidStateError
from ...format.manifest import TensorEntry
from ..reader import CheckpointReader, Progress, tensor_nbytes
from .common import ConvertInfo, progress_over, selected
from .streaming import Source

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


def export_safetensors(
    reader: CheckpointReader, dst: str, prefix: str, max_shard_bytes: int, on_progress: Progress | None
) -> ConvertInfo:
    """Tensors (plain values have no place in safetensors) into files of at most
    ``max_shard_bytes`` in the directory ``dst`` (or the one file ``dst`` when it ends
    in ``.safetensors``), written by hand from the manifest's shapes so each file
    streams one tensor at a time."""
    tensors = [
        (k, out, e) for k, out in selected(reader, prefix) if isinstance(e := reader.manifest.entries[k], TensorEntry)
    ]
    if not tensors:
        raise ValueError(f"no tensor under prefix {prefix!r} in {reader.ckdir.location}")
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
    advance = progress_over(reader, [k for k, _, _ in tensors], on_progress)
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
    skipped = len(selected(reader, prefix)) - len(tensors)
    files = (dst,) if dst.endswith(".safetensors") else tuple(names)
    return ConvertInfo(
        src=reader.ckdir.location,
        dst=dst,
        format="safetensors",
        direction="to",
        tensors=len(tensors),
        values=skipped,
        bytes=total,
        files=files,
    )


def safetensors_source(src: str) -> Source:
    """A safetensors file, or a directory of them (with or without an index)."""
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

    return Source(format="safetensors", tensors=tensors, values={}, load=load)
