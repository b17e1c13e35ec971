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


def metadata_bytes(directory: str, shard_file: Any = None) -> dict[str, int]:
    """Each file of a checkpoint directory that is not a shard file (``shard_file(name)`` false), by name."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if shard_file is None or not shard_file(name):
            out[name] = os.path.getsize(os.path.join(directory, name))
    return out


def rayckpt_block_size(layout: Layout) -> int:
    """The block size a save of ``layout`` picks (``auto_block_size`` of the whole state)."""
    from rayckpt.format.shard_file import auto_block_size

    return auto_block_size(sum(math.prod(s) * ITEMSIZE for s in layout.shapes))


def rayckpt_save_inputs(layout: Layout, world_size: int, seed: int = 0) -> tuple[Any, list[Any]]:
    """The ``SaveSpec`` and every rank's ``WrittenShard`` of a save of ``layout`` by ``world_size`` ranks."""
    from rayckpt.format.manifest import FileEntry
    from rayckpt.format.shard_file import WrittenChunk, storage_type
    from rayckpt.planning.load_plan import dim0_boxes
    from rayckpt.storage.commit import SaveSpec, WrittenShard, shard_file_name

    block = rayckpt_block_size(layout)
    save_id = "20261124T040000-0badcafe"
    spec = SaveSpec(
        save_id=save_id,
        world_size=world_size,
        block_size=block,
        tensors={k: (DTYPE, s) for k, s in zip(layout.keys, layout.shapes, strict=True)},
        values={},
        metadata={"step": 1000},
        paths=dict(zip(layout.keys, layout.paths, strict=True)),
    )
    boxes = {s: dim0_boxes(s, world_size) for s in set(layout.shapes)}
    rng = np.random.default_rng(seed)
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


def rayckpt_create_manifest(spec: Any, shards: list[Any]) -> Any:
    """What the committer runs on every save: the validated manifest of every rank's chunks."""
    from rayckpt.storage.commit import create_manifest

    return create_manifest(spec, shards)


def rayckpt_commit(directory: str, manifest: Any) -> None:
    """The commit: encode and write the manifest (and any sidecar) atomically to a local directory."""
    from rayckpt.storage.checkpoint_dir import CheckpointDir
    from rayckpt.storage.commit import commit_manifest

    commit_manifest(CheckpointDir.resolve(directory), manifest)


def rayckpt_read(directory: str) -> Any:
    """What a load runs first: read, decode and validate the committed manifest."""
    from rayckpt.storage.checkpoint_dir import CheckpointDir
    from rayckpt.storage.commit import read_manifest

    return read_manifest(CheckpointDir.resolve(directory))


def rayckpt_metadata_bytes(directory: str) -> dict[str, int]:
    from rayckpt.storage.commit import shard_file_save_id

    # A version-4 chunk table carries its save id in its name too, but it is metadata.
    return metadata_bytes(
        directory, lambda name: shard_file_save_id(name) is not None and not name.endswith("-chunks.arrow")
    )


def rayckpt_local_shards(layout: Layout, world_size: int) -> list[list[Any]]:
    """Every rank's ``LocalShard`` list: what the save planner gets after the all-gather."""
    from rayckpt.planning.load_plan import dim0_boxes
    from rayckpt.planning.save_plan import LocalShard

    boxes = {s: dim0_boxes(s, world_size) for s in set(layout.shapes)}
    return [
        [LocalShard(k, DTYPE, s, boxes[s][r]) for k, s in zip(layout.keys, layout.shapes, strict=True)]
        for r in range(world_size)
    ]


def rayckpt_shard_layouts(shards_by_rank: list[list[Any]]) -> list[Any]:
    """What each rank sends rank 0 to plan a save: its shards as columns (``ShardLayout``), made on each rank."""
    from rayckpt.planning.save_columns import ShardLayout

    return [ShardLayout.from_shards(shards) for shards in shards_by_rank]


def rayckpt_global_save_plan(layouts: list[Any]) -> Any:
    """Rank 0's part of an uncached save plan: which rank writes each distinct (key, box)."""
    from rayckpt.planning.save_columns import assign_writers

    return assign_writers(layouts)


def rayckpt_rank_save_plan(shards: list[Any], rank: int, written: Any) -> Any:
    """One rank's own part: its layout, then its plan from the shards rank 0 says it writes."""
    from rayckpt.planning.save_columns import ShardLayout
    from rayckpt.planning.save_plan import create_own_plan

    ShardLayout.from_shards(shards)
    return create_own_plan(rank, shards, written)


def rayckpt_layout_hashes(shards_by_rank: list[list[Any]]) -> list[bytes]:
    """Each rank's layout hash (``ShardLayout.digest``): each rank hashes its own, at once, on every save."""
    from rayckpt.planning.save_columns import ShardLayout

    return [ShardLayout.from_shards(shards).digest() for shards in shards_by_rank]


def rayckpt_plan_digest(hashes: list[bytes]) -> bytes:
    """The digest of every rank's layout hash, in rank order: what the plan cache is keyed by."""
    from rayckpt.planning.save_columns import digest

    return digest(*hashes)


def rayckpt_cached_save_plan(hashes: list[bytes], cached: bytes) -> bool:
    """Rank 0 on a save whose layout repeats (``engine.save_layout``): the digest of every rank's
    gathered hash against the cached one; a hit reuses the cached plan (each rank keeps its own part)."""
    return rayckpt_plan_digest(hashes) == cached


def rayckpt_chunk_table(manifest: Any) -> Any:
    """The columnar chunk table the bulk planner uses (built once per manifest, cached by the Ray actor)."""
    from rayckpt.planning.chunk_table import ChunkTable

    return ChunkTable.from_manifest(manifest)


def rayckpt_bulk_plan(manifest: Any, layout: Layout, world_size: int, table: Any) -> Any:
    """Every target rank's load plan at once (FSDP2 dim-0 targets), as the MetadataActor plans on Ray."""
    from rayckpt.planning.bulk import create_dim0_plans

    specs = [(k, DTYPE, s) for k, s in zip(layout.keys, layout.shapes, strict=True)]
    return create_dim0_plans(manifest, specs, world_size, table=table)


def rayckpt_rank_slices(manifest: Any, layout: Layout, bulk: Any) -> Any:
    """Rank 0 without Ray, after the whole job's bulk plan: every rank's slice of it (``rank_slice``)."""
    from rayckpt.format.chunk_columns import ChunkColumns
    from rayckpt.planning.rank_slice import slice_plan

    specs = [(k, DTYPE, s) for k, s in zip(layout.keys, layout.shapes, strict=True)]
    return slice_plan(bulk, specs, (), ChunkColumns.from_manifest(manifest))


def rayckpt_plan_from_slice(rank_slice: Any, layout: Layout) -> Any:
    """One rank without Ray: its load plan from the slice rank 0 scattered to it (no manifest read)."""
    return rank_slice.plan([(k, DTYPE, s) for k, s in zip(layout.keys, layout.shapes, strict=True)])


def rayckpt_rank_plan(manifest: Any, layout: Layout, world_size: int, rank: int) -> Any:
    """One target rank's load plan from the decoded manifest, as ``engine.load.plan_from_manifest`` makes it."""
    from rayckpt.planning.load_plan import TensorRequest, create_load_plan, dim0_box

    requests = [
        TensorRequest(k, DTYPE, s, dim0_box(s, world_size, rank))
        for k, s in zip(layout.keys, layout.shapes, strict=True)
    ]
    return create_load_plan(manifest, requests)


def rayckpt_manifest_chunks(manifest: Any) -> int:
    return sum(len(e.chunks) for e in manifest.entries.values() if hasattr(e, "chunks"))
