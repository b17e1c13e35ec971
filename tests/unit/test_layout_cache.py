"""The save layouts the MetadataActor keeps (``ray.layout_cache``), Ray-free: the spec split and joined
again commits the same manifest, the cache's LRU and counts, the layout digest every rank agrees on, and
what a registration weighs with and without its layout at the scale benchmark's 1,992 tensors.
The actor itself: tests/ray/test_save_layouts.py."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from benchmarks.scale_layout import gpt_layout, rayckpt_save_inputs
from rayckpt.engine import save_layout
from rayckpt.engine.save import collect_state
from rayckpt.format.manifest import encode_manifest
from rayckpt.ray.layout_cache import LayoutCache, LayoutRef, SpecLayout, join_spec, split_spec
from rayckpt.storage.commit import create_manifest
from tests.helpers.thread_ranks import ThreadGroup


@pytest.fixture(scope="module")
def gpt_save():
    """The scale benchmark's save: 1,992 tensors of a 55-layer GPT with AdamW, 4 ranks."""
    spec, shards = rayckpt_save_inputs(gpt_layout(), 4)
    spec = replace(spec, values={"step": {"int": 1000}}, previous="")
    return spec, shards


def test_a_spec_split_and_joined_commits_a_byte_identical_manifest(gpt_save):
    spec, shards = gpt_save
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
    before = replace(create_manifest(spec, shards), created=0.0)
    after = replace(create_manifest(joined, shards), created=0.0)
    assert encode_manifest(after) == encode_manifest(before)


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
    cache = LayoutCache(kept=2)
    a, b, c = (SpecLayout({k: ("float32", (2,))}, {k: (k,)}) for k in "abc")
    assert cache.get(b"A") is None
    cache.add(b"A", a)
    cache.add(b"B", b)
    assert cache.get(b"A") is a  # A is now the most recently used: C evicts B
    cache.add(b"C", c)
    assert cache.get(b"B") is None and cache.get(b"A") is a and cache.get(b"C") is c
    assert cache.counts() == {"layout_saves": 5, "layouts_received": 3, "layouts_held": 2}


def test_the_cache_keeps_at_least_one_layout():
    with pytest.raises(ValueError, match=r"LayoutCache keeps at least one layout, got kept=0"):
        LayoutCache(kept=0)


def test_every_rank_agrees_on_the_layout_digest_and_it_changes_with_the_layout():
    """``SaveContext.layout``: the same on every rank and from save to save (cached or planned),
    another digest once any rank's layout changes, the first one again when it changes back."""

    def state(rank: int, step: int, rows: int = 4) -> dict:
        return {"w": {f"r{rank}": torch.full((rows, 3), float(rank))}, "shared": torch.arange(6.0), "step": step}

    def layouts(group: ThreadGroup, rows: list[int], step: int) -> tuple[set[bytes], dict]:
        ctxs = group.run(lambda coord: collect_state(coord, state(coord.rank, step, rows[coord.rank])))
        return {c.layout for c in ctxs}, ctxs[0].spec

    save_layout.clear_plan_cache()
    try:
        group = ThreadGroup(3)
        (first,), spec = layouts(group, [4, 4, 4], 1)
        assert layouts(group, [4, 4, 4], 2)[0] == {first}  # cached plans, same digest
        (changed,), other = layouts(group, [4, 5, 4], 3)
        assert changed != first and other.tensors != spec.tensors
        save_layout.clear_plan_cache()  # planned again from scratch: the digest is the layout's, not the cache's
        (again,), same = layouts(group, [4, 4, 4], 4)
        assert again == first and (same.tensors, same.paths) == (spec.tensors, spec.paths)
    finally:
        save_layout.clear_plan_cache()
