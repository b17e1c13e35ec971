"""Whole tensors out of a checkpoint, one at a time, with no cluster: the reader the other tools share.

``CheckpointReader`` assembles full tensors from verified ranged reads (the
engine's reader) so memory stays about the largest tensor; ``consolidate`` is
DCP's full-state-dict equivalent in one process.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator
from typing import Any

import torch

from ..engine.reader import RankRead, read_into
from ..engine.state import FlatState, Piece, TensorLeaf, torch_dtype
from ..errors import CorruptCheckpointError
from ..format.boxes import Box
from ..format.manifest import Manifest, TensorEntry, ValueEntry
from ..format.paths import nest, strip_prefix
from ..format.shard_file import ShardReader
from ..format.values import decode_value
from ..planning.load_plan import ChunkIndex, TensorRequest, create_load_plan
from ..storage.checkpoint_dir import CheckpointDir
from .opening import Progress, open_checkpoint, tensor_nbytes

#: ``Progress``, ``open_checkpoint`` and ``tensor_nbytes`` live in ``opening`` (no torch); named here too.
__all__ = ["CheckpointReader", "Progress", "consolidate", "open_checkpoint", "read_tensor", "tensor_nbytes"]


def _no_such_key(manifest: Manifest, key: str, kind: str = "key") -> ValueError:
    close = difflib.get_close_matches(key, list(manifest.entries), n=3)
    hint = f"; did you mean {', '.join(repr(k) for k in close)}?" if close else "; `rayckpt inspect` lists the keys"
    return ValueError(f"no {kind} {key!r} in the checkpoint{hint}")


class CheckpointReader:
    """Assembles whole tensors of one checkpoint, one at a time, from verified ranged reads.

    Opening it reads the manifest; each tensor is read when asked for
    (``read_tensor``, ``items``), so memory stays about the largest tensor.

    Args:
        ckpt: A checkpoint directory: a local path, a ``pyarrow.fs`` URI, the
            ``manifest.json`` inside one, or a ``CheckpointDir``.

    Raises:
        CheckpointNotFoundError: ``ckpt`` does not exist, or holds no committed
            checkpoint (no ``manifest.json``); the message says what is there.
        CorruptCheckpointError: The manifest does not parse or is inconsistent
            (``FormatVersionError``: written by an unknown format version).
    """

    def __init__(self, ckpt: str | os.PathLike[str] | CheckpointDir) -> None:
        self.ckdir, self.manifest = open_checkpoint(ckpt)
        self._index = ChunkIndex(self.manifest)
        self._sizes = {f.path: f.size for f in self.manifest.files}
        # One reader for every tensor: each file is stat'ed once (``check_stored``).
        self._reader = ShardReader(self.ckdir, self.manifest.blocks, self._sizes)

    def check_stored(self, prefix: str = "") -> None:
        """Refuse, before anything is allocated, a tensor under ``prefix`` that the files on storage cannot hold.

        Its chunks' files must exist with their recorded sizes and hold its
        chunks' byte ranges, and its bytes must fit in those files (chunks of
        one tensor never share bytes). A manifest that describes a 4 TiB tensor
        over a few small files fails here, naming the tensor and the bytes.
        """
        for key, entry in self.manifest.entries.items():
            if key.startswith(prefix) and isinstance(entry, TensorEntry):
                self._check_stored(key, entry)

    def _check_stored(self, key: str, entry: TensorEntry) -> None:
        need = tensor_nbytes(entry)
        files = sorted({c.file for c in entry.chunks})
        try:
            self._reader.check_ranges((c.file, c.byte_offset, c.byte_length) for c in entry.chunks)
            held = sum(self._sizes[f] for f in files)
            if need > held:
                raise CorruptCheckpointError(
                    f"its shard files ({', '.join(map(repr, files))}) hold only {held} bytes: its chunks share bytes"
                )
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{self.ckdir.location}: tensor {key!r} ({entry.dtype} {list(entry.shape)}) would need {need} bytes "
                f"({need / 2**30:.1f} GiB); refusing to allocate it: {exc}"
            ) from None

    def read_tensor(self, key: str) -> torch.Tensor:
        """The full tensor ``key``, every byte verified against its checksum.

        Checked against the files on storage (``check_stored``) before it is allocated.
        """
        entry = self.manifest.entries.get(key)
        if not isinstance(entry, TensorEntry):
            if isinstance(entry, ValueEntry):
                raise ValueError(f"key {key!r} holds a plain value ({decode_value(entry.value)!r}), not a tensor")
            raise _no_such_key(self.manifest, key, "tensor")
        self._check_stored(key, entry)
        target = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        box = Box.full(entry.shape)
        flat = FlatState(
            tensors={key: TensorLeaf(key=key, pieces=(Piece(box, target),), shape=entry.shape, dtype=entry.dtype)}
        )
        request = TensorRequest(key, entry.dtype, entry.shape, box)
        plan = create_load_plan(self.manifest, [request], index=self._index)
        read_into(
            self.ckdir, RankRead(plan=plan, blocks=self.manifest.blocks, file_sizes=self._sizes), flat, self._reader
        )
        return target

    def items(self, prefix: str = "", on_progress: Progress | None = None) -> Iterator[tuple[str, Any]]:
        """(key, tensor or decoded value) for every entry whose key starts with ``prefix``, in manifest order."""
        keys = [k for k in self.manifest.entries if k.startswith(prefix)]
        total = sum(tensor_nbytes(e) for k in keys if isinstance(e := self.manifest.entries[k], TensorEntry))
        done = 0
        for key in keys:
            entry = self.manifest.entries[key]
            if isinstance(entry, TensorEntry):
                # No local holds the tensor: once the caller drops it, it is freed.
                yield key, self.read_tensor(key)
                done += tensor_nbytes(entry)
                if on_progress:
                    on_progress(done, total)
            else:
                yield key, decode_value(entry.value)


def read_tensor(ckpt: str | os.PathLike[str] | CheckpointDir, key: str) -> torch.Tensor:
    """Assemble the full tensor ``key`` from its shards without loading anything else.

    Args:
        ckpt: A checkpoint directory: a local path, a ``pyarrow.fs`` URI, the
            ``manifest.json`` inside one, or a ``CheckpointDir``.
        key: The tensor's flattened key, as ``inspect`` lists it.

    Returns:
        The whole tensor, on the CPU, every byte verified against its checksum.

    Raises:
        ValueError: ``key`` is not a tensor of the checkpoint (the message
            suggests close keys, or names the plain value it holds).
        CheckpointNotFoundError: ``ckpt`` does not exist, or holds no committed
            checkpoint (no ``manifest.json``); the message says what is there.
        CorruptCheckpointError: The manifest is inconsistent, the tensor's shard
            files cannot hold it (refused before it is allocated), or a byte fails
            its checksum.
    """
    return CheckpointReader(ckpt).read_tensor(key)


def consolidate(
    ckpt: str | os.PathLike[str] | CheckpointDir,
    *,
    prefix: str = "",
    flat: bool = False,
    on_progress: Progress | None = None,
) -> dict[Any, Any]:
    """The full (unsharded) state dict in this process: DCP's full-state-dict / rank-0 equivalent.

    Holds the whole selection in memory, by design. Every tensor of it is checked
    against the files on storage before any is allocated.

    Args:
        ckpt: A checkpoint directory: a local path, a ``pyarrow.fs`` URI, the
            ``manifest.json`` inside one, or a ``CheckpointDir``.
        prefix: Only keys under it, with the prefix removed (``prefix="app.model."``
            gives a model's ``state_dict``); "": every key.
        flat: Whether to return the checkpoint's flattened keys
            (``app.model.layers.0.weight``) instead of the nesting that was saved.
        on_progress: Called with (tensor bytes read, tensor bytes in all) after
            each tensor.

    Returns:
        Whole tensors (on the CPU) and plain Python values, nested as they were
            saved (``{"app": {"model": {"layers.0.weight": tensor}}}``; flat keys
            for checkpoints older than format version 3), or flat with ``flat=True``.

    Raises:
        CheckpointNotFoundError: ``ckpt`` does not exist, or holds no committed
            checkpoint (no ``manifest.json``); the message says what is there.
        CorruptCheckpointError: The manifest is inconsistent, a tensor's shard
            files cannot hold it, or a byte fails its checksum.
    """
    reader = CheckpointReader(ckpt)
    reader.check_stored(prefix)
    items = reader.items(prefix, on_progress)
    if flat:
        return {key[len(prefix) :]: value for key, value in items}
    return nest((strip_prefix(reader.manifest.path(key), key, prefix), value) for key, value in items)
