"""The scale benchmark's DCP ``.metadata`` against a real ``dcp.save`` of the same layout (4 gloo ranks).

``benchmarks.scale.dcp.build_metadata`` makes DCP's metadata for thousands of ranks
without running DCP; here 4 ranks save that layout (a small GPT's parameters and
AdamW states as FSDP2 ``Shard(0)`` DTensors, some with empty shards) with
``dcp.save`` and the metadata it pickled is compared field by field.
"""

from __future__ import annotations

import os
import pickle

import pytest

from benchmarks.scale import dcp as dcp
from benchmarks.scale import layout as lay
from rayckpt.testing.multiproc import run_ranks
from tests.helpers.scale_dcp import real_save_worker

pytestmark = pytest.mark.slow
WORLD = 4


def test_built_metadata_matches_a_real_dcp_save(tmp_path):
    layout = lay.gpt_layout(30, n_layers=1, d_model=8, d_ff=32, n_heads=2, vocab_size=16, seq_len=2)
    path = str(tmp_path / "dcp")
    run_ranks(real_save_worker, WORLD, layout, path)
    real = dcp.read_metadata(path)
    mine = dcp.build_metadata(layout, WORLD, path)
    assert mine.state_dict_metadata == real.state_dict_metadata  # a chunk per rank, FSDP2's offsets and sizes
    assert mine.planner_data == real.planner_data and mine.version == real.version
    assert mine.storage_meta.checkpoint_id == real.storage_meta.checkpoint_id

    def entries(md):
        return {(k.fqn, k.offset, k.index): v for k, v in md.storage_data.items()}

    got, want = entries(mine), entries(real)
    assert got.keys() == want.keys()
    # The pos_emb tensors (2 rows) have two empty shards: DCP keeps one, on a rank of its choosing.
    empty = {k for k in want if k[0].endswith("pos_emb.weight") or "pos_emb.weight." in k[0]}
    assert len(empty) == 3 * 3
    assert {k: v.relative_path for k, v in got.items() if k not in empty} == {
        k: v.relative_path for k, v in want.items() if k not in empty
    }
    # Lengths: ``torch.save``'s zip framing varies by a few bytes with the data's alignment.
    assert all(abs(got[k].length - want[k].length) < 64 for k in want)
    size = os.path.getsize(os.path.join(path, dcp.METADATA_NAME))
    assert abs(len(pickle.dumps(mine)) - size) / size < 0.02
