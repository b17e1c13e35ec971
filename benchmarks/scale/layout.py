"""The scale benchmark's layout and rayckpt's side of it: synthetic metadata, no tensors."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

DTYPE = "float32"
ITEMSIZE = 4
#: The GPT of the scale benchmark: 55 layers, d_model 4096 (MLP 4x), GPT-2's padded vocabulary, tied head.
GPT_SHAPE = {"n_layers": 55, "d_model": 4096, "d_ff": 16384, "n_heads": 32, "vocab_size": 50304, "seq_len": 2048}
OPTIM_STATES = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True)
class Layout:
    """The tensors of the state dict: flat key (DCP's fqn), nested path, global shape; all float32."""

    keys: tuple[str, ...]
    paths: tuple[tuple[str, ...], ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def tensors(self) -> int:
        return len(self.keys)

    def by_shape(self) -> dict[tuple[int, ...], list[int]]:
        """Tensor indices grouped by shape (in key order)."""
        out: dict[tuple[int, ...], list[int]] = {}
        for i, shape in enumerate(self.shapes):
            out.setdefault(shape, []).append(i)
        return out

    def subset(self, indices: list[int]) -> Layout:
        return Layout(
            tuple(self.keys[i] for i in indices),
            tuple(self.paths[i] for i in indices),
            tuple(self.shapes[i] for i in indices),
        )


@cache
def gpt_parameters(**shape: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter of ``examples.gpt.GPT`` (built on the meta device: no memory)."""
    import torch

    from rayckpt.examples.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(tie_head=True, **shape))
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def gpt_layout(tensors: int = 1992, **shape: int) -> Layout:
    """The first ``tensors`` tensors of the model + AdamW state dict (params, then each one's states)."""
    params = gpt_parameters(**{**GPT_SHAPE, **shape})
    wanted = params[: -(-tensors // (1 + len(OPTIM_STATES)))]
    paths = [("model", name) for name, _ in wanted]
    paths += [("optim", "state", name, s) for name, _ in wanted for s in OPTIM_STATES]
    shapes = [p for _, p in wanted] + [p for _, p in wanted for _ in OPTIM_STATES]
    paths, shapes = paths[:tensors], shapes[:tensors]
    return Layout(tuple(".".join(p) for p in paths), tuple(paths), tuple(shapes))


def sampled(layout: Layout, stride: int) -> Layout:
    """Every ``stride``-th tensor of each shape (a layout that keeps the shapes' mix, ~1/stride of the chunks)."""
    return layout.subset(sorted(i for idx in layout.by_shape().values() for i in idx[::stride]))


def chunk_count(layout: Layout, world_size: int) -> int:
    """The non-empty dim-0 shards of the layout over ``world_size`` ranks (the manifest's chunks)."""
    rows = {s: s[0] if s else 1 for s in set(layout.shapes)}
    return sum(min(world_size, -(-rows[s] // max(1, -(-rows[s] // world_size)))) for s in layout.shapes)


def dim0_rows(shape: tuple[int, ...], world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s first row and row count under FSDP2 (``dim0_box``)."""
    from rayckpt.planning.load_plan import dim0_box

    box = dim0_box(shape, world_size, rank)
    return box.offsets[0], box.sizes[0]


def row_bytes(shape: tuple[int, ...]) -> int:
    return ITEMSIZE * int(np.prod(shape[1:], dtype=np.int64))


def metadata_bytes(directory: str) -> dict[str, int]:
    """Each file of a checkpoint directory by name (only metadata: no tensor data is ever written here)."""
    return {name: os.path.getsize(os.path.join(directory, name)) for name in sorted(os.listdir(directory))}


def rayckpt_block_size(layout: Layout) -> int:
    """The block size a save of ``layout`` picks (``auto_block_size`` of the whole state)."""
    from rayckpt.format.shard_file import auto_block_size

    return auto_block_size(sum(math.prod(s) * ITEMSIZE for s in layout.shapes))


def rayckpt_save_inputs(layout: Layout, world_size: int, block_size: int | None = None) -> tuple[Any, list[Any]]:
    """The ``SaveSpec`` and every rank's ``WrittenShard`` of a save of ``layout`` by ``world_size`` ranks (with
    the block size a save of it picks, or ``block_size``)."""
    from rayckpt.format.manifest import FileEntry
    from rayckpt.format.shard_file import WrittenChunk, storage_type
    from rayckpt.planning.load_plan import dim0_boxes
    from rayckpt.storage.commit import SaveSpec, WrittenShard, shard_file_name

    block = block_size or rayckpt_block_size(layout)
    save_id = "20261124T040000-0badcafe"
    tensors = {k: (DTYPE, s) for k, s in zip(layout.keys, layout.shapes, strict=True)}
    paths = dict(zip(layout.keys, layout.paths, strict=True))
    ids = {"save_id": save_id, "world_size": world_size, "block_size": block}
    spec = SaveSpec(**ids, tensors=tensors, values={}, metadata={"step": 1000}, paths=paths)
    boxes = {s: dim0_boxes(s, world_size) for s in set(layout.shapes)}
    rng = np.random.default_rng(0)
    shards = []
    for rank in range(world_size):
        file = shard_file_name(save_id, rank, storage_type(DTYPE))
        # In key order, as rayckpt's writers lay out a shard file (the manifest's order too).
        mine = [(k, boxes[s][rank]) for k, s in sorted(zip(layout.keys, layout.shapes)) if boxes[s][rank].volume]
        lengths = [b.volume * ITEMSIZE for _, b in mine]
        blocks = [-(-n // block) for n in lengths]
        sums = rng.integers(0, 2**64, size=sum(blocks), dtype=np.uint64).tolist()
        chunks, pos, at = [], 0, 0
        for (key, box), n, nb in zip(mine, lengths, blocks, strict=True):
            chunks.append(
                WrittenChunk(
                    key=key, box=box, file=file, byte_offset=pos, byte_length=n, checksums=tuple(sums[at : at + nb])
                )
            )
            pos, at = pos + -(-n // 64) * 64, at + nb
        files = (FileEntry(file, pos, rank),) if chunks else ()
        shards.append(WrittenShard(rank, tuple(chunks), files))
    return spec, shards


def rayckpt_local_shards(layout: Layout, world_size: int) -> list[list[Any]]:
    """Every rank's ``LocalShard`` list: what the save planner gets after the all-gather."""
    from rayckpt.planning.load_plan import dim0_boxes
    from rayckpt.planning.save_plan import LocalShard

    boxes = {s: dim0_boxes(s, world_size) for s in set(layout.shapes)}
    return [
        [LocalShard(k, DTYPE, s, boxes[s][r]) for k, s in zip(layout.keys, layout.shapes, strict=True)]
        for r in range(world_size)
    ]


def specs(layout: Layout) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, dtype, global shape) of every tensor: what the load planners are asked for."""
    return [(k, DTYPE, s) for k, s in zip(layout.keys, layout.shapes, strict=True)]
