"""The scale benchmark's measurement functions at a few ranks: the metadata it builds is what each library makes.

``benchmarks.scale.run`` times rayckpt and DCP on synthetic metadata; these checks
keep that metadata honest: rayckpt's manifest validates and its plans agree, DCP's
``Metadata`` has a chunk per (tensor, rank) with FSDP2's offsets and sizes and is
byte for byte what DCP's own planner builds through its collectives' pickling.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from benchmarks.scale import dcp as dcp
from benchmarks.scale import layout as lay
from benchmarks.scale import run as bench
from benchmarks.scale.plot import write_plot
from benchmarks.scale.report import fit_exponent, fit_exponents, markdown, targets
from rayckpt.planning.load_plan import dim0_box
from tests.helpers.scale_dcp import metadata_via_planner

#: A GPT small enough to plan at once; its position table (2 rows) has empty shards past 2 ranks.
SMALL = {"n_layers": 1, "d_model": 8, "d_ff": 32, "n_heads": 2, "vocab_size": 16, "seq_len": 2}


@pytest.fixture(scope="module")
def layout() -> lay.Layout:
    return lay.gpt_layout(20, **SMALL)


def test_the_layout_is_a_55_layer_gpt_with_adamw_state():
    full = lay.gpt_layout()
    assert full.tensors == 1992
    assert len({p[-2] if p[0] == "optim" else p[1] for p in full.paths}) == 664
    assert full.keys[0] == "model.tok_emb.weight" and full.shapes[0] == (50304, 4096)
    assert full.keys[664:666] == ("optim.state.tok_emb.weight.exp_avg", "optim.state.tok_emb.weight.exp_avg_sq")
    wide = [p for p, s in zip(full.paths, full.shapes, strict=True) if s == (4096, 16384)]
    assert wide[0] == ("model", "blocks.0.out.weight") and len(wide) == 55 * 3


def test_rayckpt_steps_validate_the_manifest_and_plans_agree(layout, tmp_path):
    commit = bench.rayckpt_commit(layout, 4, str(tmp_path))
    nonempty = sum(dim0_box(s, 4, r).volume > 0 for s in layout.shapes for r in range(4))
    assert commit["chunks"] == nonempty
    # The metadata: the chunk table and manifest.json (format version 4), not the shard files.
    assert sorted(commit["files"]) == ["20261124T040000-0badcafe-chunks.arrow", "manifest.json"]
    assert commit["metadata_bytes"] == sum(commit["files"].values()) > 0
    assert {"cpu_s", "wall_s", "extra_rss"} <= commit["create_manifest"].keys()
    load = bench.rayckpt_load(layout, 4, str(tmp_path))  # read_manifest validates what the commit wrote
    assert sorted(load["targets"]) == [2, 3]
    assert all(t["from_slice_equals_for_rank"] and t["slice_bytes"] > 0 for t in load["targets"].values())
    plan = bench.rayckpt_save_plan(layout, 4)
    assert plan["write_items"] == nonempty
    assert {"save_plan", "cached_save_plan"} <= plan.keys()


def test_dcp_metadata_has_a_chunk_per_tensor_and_rank_with_fsdp2_offsets():
    layout = lay.gpt_layout(20)  # every tensor has >= 8 rows
    md = dcp.build_metadata(layout, 8, "/ck")
    for key, shape in zip(layout.keys, layout.shapes, strict=True):
        chunks = md.state_dict_metadata[key].chunks
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [
            (dim0_box(shape, 8, r).offsets, dim0_box(shape, 8, r).sizes) for r in range(8)
        ]
    assert len(md.storage_data) == dcp.metadata_chunks(md) == 20 * 8
    files = [info.relative_path for info in md.storage_data.values()]
    assert files == [f"__{r}_0.distcp" for r in range(8) for _ in range(20)]


def test_empty_shards_are_kept_once_as_dcp_dedups_them(layout):
    md = dcp.build_metadata(layout, 4, "/ck")
    pos = md.state_dict_metadata["model.pos_emb.weight"].chunks  # 2 rows over 4 ranks
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in pos] == [((0, 0), (1, 8)), ((1, 0), (1, 8)), ((2, 0), (0, 8))]


@pytest.mark.parametrize(("small", "ranks"), [(True, 4), (True, 8), (False, 4)])
def test_dcp_metadata_is_what_dcps_planner_pickles(small, ranks):
    layout = lay.gpt_layout(20, **SMALL) if small else lay.gpt_layout(20)
    ref, local = metadata_via_planner(layout, ranks, "/ck")
    mine = dcp.build_metadata(layout, ranks, "/ck")
    assert mine.state_dict_metadata == ref.state_dict_metadata
    assert mine.planner_data == ref.planner_data
    assert mine.storage_meta == ref.storage_meta and mine.version == ref.version

    def index(md):
        return {(k.fqn, k.offset, k.index) for k in md.storage_data}

    assert index(mine) == index(ref)
    assert len(pickle.dumps(mine)) == len(pickle.dumps(ref))
    if not small:  # the same objects shared the same way (DCP keeps an empty shard on another rank than ours)
        assert pickle.dumps(mine) == pickle.dumps(ref)
    assert dcp.local_save_plans(layout, ranks) == local


def test_dcp_steps_time_plans_and_estimate_past_the_budget(layout, tmp_path):
    assert (
        bench.dcp_commit(layout, 4, str(tmp_path))["chunks"] == 20 * 4 - 3
    )  # pos_emb and its two states: 2 rows, 3 ranks keep one
    load = bench.dcp_load(layout, 4, str(tmp_path), budget_s=60, samples=2)
    assert not load["targets"][3]["whole_job"]["estimated"] and load["targets"][3]["read_items"] > 0
    sampled = bench.dcp_load(layout, 4, str(tmp_path), budget_s=0, samples=2)["targets"][2]["whole_job"]
    assert sampled["estimated"] and sorted(sampled["sample"]) == [0, 1]
    full = bench.dcp_save_plan(layout, 4, budget_s=60)
    assert not full["uncached"]["estimated"] and full["cached"]["cpu_s"] >= 0
    assert [p["tensors"] for p in full["per_shape"]] == [len(v) for v in layout.by_shape().values()]
    est = bench.dcp_save_plan(layout, 4, budget_s=0)["uncached"]
    assert est["estimated"] and est["cpu_s"] > 0
    assert not torch.distributed.is_initialized()


def test_fit_exponent_recovers_the_power():
    assert fit_exponent([(n, 3.0 * n**1.5) for n in (64, 256, 1024, 4096)]) == pytest.approx(1.5)
    assert fit_exponent([(64, 1.0), (4096, 64.0)]) == pytest.approx(1.0)


def test_report_marks_targets_and_renders(layout, tmp_path):
    args = type("Args", (), {"budget_s": 60.0, "dcp_sample_ranks": 2})()
    results = {str(n): {s: bench.run_step(s, layout, n, str(tmp_path), args) for s in bench.STEPS} for n in (4, 8)}
    report = {"command": "x", "date": "d", "machine": {"nproc": 2, "mem_total_gb": 25}, "results": results}
    report["config"] = {"tensors": 20, "model": SMALL, "block_size": lay.rayckpt_block_size(lay.gpt_layout(20))}
    report["fits"] = fit_exponents(report)
    rows = {t["target"]: t for t in targets(report)}
    assert rows["global save plan at 4,096 ranks (s)"]["met"] is None  # 4,096 not measured
    assert rows["manifest / DCP .metadata, every N"]["met"] is not None
    assert report["fits"]["dcp_bytes"]["exponent"] > 0
    report["targets"] = list(rows.values())
    md = markdown(report)
    assert "| figure | 4 | 8 |" in md and "| chunks, DCP | 77 | 145 |" in md
    write_plot(report, str(tmp_path / "plot.svg"))
    svg = (tmp_path / "plot.svg").read_text()
    assert "<svg" in svg and "Metadata size" in svg and "saved ranks N" in svg


def test_sampling_keeps_each_shape_and_scales_by_chunks():
    full = lay.gpt_layout()
    half = lay.sampled(full, 2)
    assert half.tensors == 1000 and set(half.shapes) == set(full.shapes)
    assert lay.chunk_count(full, 4096) == sum(
        dim0_box(s, 4096, r).volume > 0 for s in full.shapes[:3] for r in range(4096)
    ) + lay.chunk_count(full.subset(list(range(3, full.tensors))), 4096)
    assert lay.chunk_count(lay.gpt_layout(21, **SMALL).subset([0, 1, 2]), 4) == 4 + 2 + 4  # 16, 2, 8 rows
    step = {"metadata_bytes": 100, "read": {"cpu_s": 2.0, "extra_rss": 10}, "scale": 2.5}
    from benchmarks.scale.report import figures

    f = figures({"rayckpt_commit": step, "rayckpt_load": step}, 8)
    assert f["rayckpt_bytes"] == 250 and f["rayckpt_read"] == 5.0 and f["rayckpt_est"] and not f["dcp_est"]
