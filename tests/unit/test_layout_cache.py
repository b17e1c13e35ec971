"""The save layouts the MetadataActor keeps (``ray.layout_cache``), Ray-free: the spec and every rank's
shard split and joined again commit a byte-identical manifest, the cache's LRU, budget and counts, the
layout digest every rank agrees on, and what a registration and a rank's report weigh with and without
their layouts at the scale benchmark's 1,992 tensors. The actor itself: tests/ray/test_save_layouts.py."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch

from benchmarks.scale.layout import gpt_layout, rayckpt_save_inputs
from rayckpt.engine.save import collect_state
from rayckpt.engine.save_layout import PlanCache
from rayckpt.errors import SaveFailedError
from rayckpt.format.manifest import FileEntry
from rayckpt.format.manifest_files import manifest_file_bytes
from rayckpt.format.shard_file import WrittenChunk
from rayckpt.planning.load_plan import dim0_box
from rayckpt.ray.metadata.layout_cache import (
    LayoutCache,
    LayoutRef,
    SaveLayouts,
    SpecLayout,
    join_shard,
    join_spec,
    split_shard,
    split_spec,
)
from rayckpt.storage.commit import WrittenShard, create_manifest, shard_file_name
from tests.helpers.thread_ranks import ThreadGroup


@pytest.fixture(scope="module")
def gpt_save():
    """The scale benchmark's save: 1,992 tensors of a 55-layer GPT with AdamW, 4 ranks."""
    spec, shards = rayckpt_save_inputs(gpt_layout(), 4)
    spec = replace(spec, values={"step": {"int": 1000}}, previous="")
    return spec, shards


def test_a_spec_and_shards_split_and_joined_commit_a_byte_identical_manifest(gpt_save):
    spec, shards = gpt_save
    shards = [*shards, WrittenShard(4, (), ())]  # a rank with nothing to write (a world of 5)
    spec = replace(spec, world_size=5)
    light, layout = split_spec(spec)
    assert (light.tensors, light.paths) == ({}, {})
    assert (light.save_id, light.values, light.metadata, light.previous) == (
        spec.save_id,
        spec.values,
        spec.metadata,
        spec.previous,
    )
    # what crosses to the actor: pickled, as Ray sends arguments
    joined = join_spec(pickle.loads(pickle.dumps(light)), pickle.loads(pickle.dumps(layout)))
    assert joined == spec and list(joined.tensors) == list(spec.tensors) and list(joined.paths) == list(spec.paths)
    reports = [pickle.loads(pickle.dumps(split_shard(s))) for s in shards]
    rebuilt = [join_shard(r.without_layout(), r.chunks) for r in reports]
    assert rebuilt == shards
    before = replace(create_manifest(spec, shards), created=0.0)
    after = replace(create_manifest(joined, rebuilt), created=0.0)
    assert manifest_file_bytes(after) == manifest_file_bytes(before)  # the chunk table and the JSON


def rank_shard(world_size: int, rank: int, save_id: str, seed: int) -> WrittenShard:
    """One rank's ``WrittenShard`` of the scale benchmark's save (as ``rayckpt_save_inputs`` makes
    every rank's): its dim-0 share of each of 1,992 tensors, back to back, random checksums."""
    layout, file = gpt_layout(), shard_file_name(save_id, rank, "float")
    rng, chunks, pos = np.random.default_rng(seed), [], 0
    for key, shape in zip(layout.keys, layout.shapes, strict=True):
        box = dim0_box(shape, world_size, rank)
        if box.volume:
            n = box.volume * 4
            sums = tuple(rng.integers(0, 2**64, size=-(-n // 65536), dtype=np.uint64).tolist())
            chunks.append(WrittenChunk(key=key, box=box, file=file, byte_offset=pos, byte_length=n, checksums=sums))
            pos += -(-n // 64) * 64
    return WrittenShard(rank, tuple(chunks), (FileEntry(file, pos, rank),))


def test_a_rank_report_without_its_chunk_layout_is_a_fraction_of_its_shard():
    """``report_written``'s shard at 1,992 tensors, dim-0 sharded over 1,024 ranks (rank 0's):
    today's ``WrittenShard`` vs the report without its chunk layout (keys, boxes, files)."""
    shard = rank_shard(1024, 0, "20261124T040000-0badcafe", seed=0)
    report = split_shard(shard)
    full, later = len(pickle.dumps(shard)), len(pickle.dumps(report.without_layout()))
    assert len(shard.chunks) == 1992 and full > 150_000 and later < 0.5 * full
    # the same chunks written by the next save (other checksums, other file names): the same layout
    again = split_shard(rank_shard(1024, 0, "20261124T050000-1badcafe", seed=1))
    assert again.layout == report.layout and again.checksums.tolist() != report.checksums.tolist()
    assert split_shard(rank_shard(1024, 1, "20261124T040000-0badcafe", seed=0)).layout != report.layout


def test_a_chunk_layout_that_does_not_fit_the_report_is_refused_naming_the_rank():
    chunk = replace(split_shard(WrittenShard(0, (), ())), rank=3)
    other = split_shard(rayckpt_save_inputs(gpt_layout(4), 2)[1][0])
    with pytest.raises(ValueError, match=rf"rank 3: chunk layout {chunk.layout.hex()} has 4 chunks, the report 0"):
        join_shard(chunk, other.chunks)


def test_a_registration_without_its_layout_weighs_bytes_not_the_tensors(gpt_save):
    """The arguments of ``begin_save`` at 1,992 tensors: the full spec vs the spec without its layout
    plus a ``LayoutRef`` (a 16-byte digest; an object reference pickles to about the same as ``ref``)."""
    spec, _ = gpt_save
    light, layout = split_spec(spec)
    where = ("/ckpt/rayckpt-step-00001000", None, "run", 1000, 600.0)
    full = len(pickle.dumps((spec, *where, None)))
    sent = len(pickle.dumps((light, *where, LayoutRef(b"d" * 16, b"r" * 28))))
    assert full > 150_000 and sent < 1_000
    assert len(pickle.dumps(layout)) > 0.95 * full  # the layout is what a repeated save no longer sends


def test_the_cache_keeps_the_most_recently_used_layouts_and_counts_what_it_received():
    cache = LayoutCache(("layout_saves", "layouts_received", "layouts_held"), kept=2)
    a, b, c = (SpecLayout({k: ("float32", (2,))}, {k: (k,)}) for k in "abc")
    assert cache.get(b"A") is None
    cache.add(b"A", a)
    cache.add(b"B", b)
    assert cache.get(b"A") is a  # A is now the most recently used: C evicts B
    cache.add(b"C", c)
    assert cache.get(b"B") is None and cache.get(b"A") is a and cache.get(b"C") is c
    assert cache.counts() == {"layout_saves": 5, "layouts_received": 3, "layouts_held": 2}


def test_the_chunk_cache_keeps_chunks_up_to_its_budget_and_always_the_most_recent_layout():
    shards = rayckpt_save_inputs(gpt_layout(6), 2)[1]  # 6 chunks per rank
    reports = [split_shard(s) for s in shards]
    cache = LayoutCache(("uses", "received", "held"), kept=8, weight=len)
    cache.add(reports[0].layout, reports[0].chunks)
    cache.add(reports[1].layout, reports[1].chunks)  # 12 > 8 chunks: the older one goes
    assert cache.get(reports[0].layout) is None and cache.get(reports[1].layout) is reports[1].chunks
    assert cache.counts() == {"uses": 2, "received": 2, "held": 1}


def test_the_actor_layouts_keep_what_was_sent_and_name_a_save_whose_layout_is_not_one():
    layouts = SaveLayouts()
    report = split_shard(rayckpt_save_inputs(gpt_layout(6), 2)[1][1])
    assert layouts.chunk_layout(report.without_layout()) is None  # neither held nor sent: LAYOUT_WANTED
    held = layouts.chunk_layout(report)
    assert held.keys == report.chunks.keys and layouts.chunk_layout(report.without_layout()) is held
    spec = SpecLayout({"w": ("float32", (2,))}, {"w": ("w",)})
    assert layouts.add_spec(b"s" * 16, spec, "sid", "run", 1) is spec and layouts.specs.get(b"s" * 16) is spec
    with pytest.raises(SaveFailedError) as caught:
        layouts.add_spec(b"\x01" * 16, OSError("owner died"), "sid-x", "gone", 4)
    assert str(caught.value) == (
        f"save sid-x of run 'gone' (step 4): this MetadataActor does not hold its layout {'01' * 16} "
        "and fetching it from rank 0 gave OSError: owner died"
    )
    assert layouts.counts() == {
        "layout_saves": 1,
        "layouts_received": 1,
        "layouts_held": 1,
        "chunk_layout_reports": 3,
        "chunk_layouts_received": 1,
        "chunk_layouts_held": 1,
    }


def test_the_cache_keeps_at_least_one_layout():
    with pytest.raises(ValueError, match=r"LayoutCache keeps at least one layout, got kept=0"):
        LayoutCache(("uses", "received", "held"), kept=0)


def test_every_rank_agrees_on_the_layout_digest_and_it_changes_with_the_layout():
    """``SaveContext.layout``: the same on every rank and from save to save (cached or planned),
    another digest once any rank's layout changes, the first one again when it changes back."""

    def state(rank: int, step: int, rows: int = 4) -> dict:
        return {"w": {f"r{rank}": torch.full((rows, 3), float(rank))}, "shared": torch.arange(6.0), "step": step}

    def layouts(group: ThreadGroup, rows: list[int], step: int) -> tuple[set[bytes], dict]:
        ctxs = group.run(
            lambda coord: collect_state(coord, state(coord.rank, step, rows[coord.rank]), plans=plans[coord.rank])
        )
        return {c.layout for c in ctxs}, ctxs[0].spec

    plans = [PlanCache() for _ in range(3)]
    group = ThreadGroup(3)
    (first,), spec = layouts(group, [4, 4, 4], 1)
    assert layouts(group, [4, 4, 4], 2)[0] == {first}  # cached plans, same digest
    (changed,), other = layouts(group, [4, 5, 4], 3)
    assert changed != first and other.tensors != spec.tensors
    for p in plans:
        p.clear()  # planned again from scratch: the digest is the layout's, not the cache's
    (again,), same = layouts(group, [4, 4, 4], 4)
    assert again == first and (same.tensors, same.paths) == (spec.tensors, spec.paths)


def test_a_new_ray_session_with_the_same_job_id_puts_the_layout_again(monkeypatch):
    from types import SimpleNamespace

    from rayckpt.ray.rank import async_save

    session = {"node": "node-a"}
    context = SimpleNamespace(get_job_id=lambda: "01000000", get_node_id=lambda: session["node"])
    puts = []
    monkeypatch.setattr(async_save.ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(async_save.ray, "put", lambda value: puts.append(value) or f"ref-{len(puts)}")
    saver = async_save.AsyncSaver()
    first = saver._layout_ref(b"digest", "layout")
    assert saver._layout_ref(b"digest", "layout") is first and puts == ["layout"]  # reused within the session
    session["node"] = "node-b"  # ray.shutdown(), ray.init(): the job id repeats, the node id does not
    again = saver._layout_ref(b"digest", "layout")
    assert again.ref == "ref-2" and puts == ["layout", "layout"]
