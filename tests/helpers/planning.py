"""Hand-built manifests for planner tests: chunks laid out in fake files with known bytes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from rayckpt.format.boxes import Box, row_major_strides
from rayckpt.format.manifest import (
    ChunkEntry,
    FileEntry,
    Manifest,
    TensorEntry,
    ValueEntry,
    itemsize,
)
from rayckpt.format.manifest_checks import find_manifest_problems
from rayckpt.format.values import encode_value

#: Filler bytes at the start of every fake file (where an Arrow header would be).
HEADER = 64


@dataclass
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    #: (chunk box, file) in the order the chunks are laid out
    placed: list[tuple[Box, str]]


def value_at(key_index: int, flat: int) -> int:
    return key_index * 1000 + flat


def build(
    tensors: dict[str, Tensor],
    block_size: int,
    pad: int = 0,
    header: int = HEADER,
    values: dict | None = None,
) -> tuple[Manifest, dict[str, bytes]]:
    """Lay the chunks out in fake files, ``pad`` filler bytes between chunks.

    Each element's bytes hold ``value_at(key index, global row-major index)``.
    """
    files: dict[str, bytearray] = {}
    entries: dict = {}
    for k, (key, t) in enumerate(tensors.items()):
        isz = itemsize(t.dtype)
        strides = row_major_strides(t.shape)
        chunks = []
        for box, fname in t.placed:
            buf = files.setdefault(fname, bytearray(b"\xaa" * header))
            if len(buf) > header:
                buf.extend(b"\xee" * pad)
            off = len(buf)
            for idx in itertools.product(*(range(o, o + s) for o, s in zip(box.offsets, box.sizes))):
                flat = sum(i * s for i, s in zip(idx, strides))
                buf.extend(value_at(k, flat).to_bytes(isz, "little"))
            n = box.volume * isz
            chunks.append(
                ChunkEntry(box=box, file=fname, byte_offset=off, byte_length=n, checksums=(0,) * -(-n // block_size))
            )
        entries[key] = TensorEntry(t.dtype, t.shape, tuple(chunks))
    for key, v in (values or {}).items():
        entries[key] = ValueEntry(encode_value(v, key))
    file_entries = tuple(FileEntry(name, len(buf), i) for i, (name, buf) in enumerate(sorted(files.items())))
    m = Manifest(
        save_id="test", world_size=len(file_entries), block_size=block_size, entries=entries, files=file_entries
    )
    assert find_manifest_problems(m) == []
    return m, {name: bytes(buf) for name, buf in files.items()}
