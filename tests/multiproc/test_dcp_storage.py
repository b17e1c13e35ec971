"""``dcp.save`` / ``load`` / ``async_save`` with rayckpt's writer, reader and stager: FSDP2 + AdamW on gloo ranks."""

from __future__ import annotations

import pytest
import torch

import rayckpt
from rayckpt.testing.multiproc import run_ranks
from rayckpt.testing.toy import ToyModel, fixed_input
from tests.helpers import dcp_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp"))


@pytest.fixture(scope="module")
def saved(root):
    """Saved by 4 ranks: rayckpt's writer, ``rayckpt.save``, incremental chains of both, the tied GPT."""
    return run_ranks(dcp_workers.save_many, 4, root)


@pytest.fixture(scope="module")
def loaded(root, saved):
    """Everything ``saved`` loaded by 3 ranks."""
    return run_ranks(dcp_workers.load_many, 3, root)


@pytest.fixture(scope="module")
def async_saved(root):
    """``dcp.async_save`` on 2 ranks: a thread, rayckpt's stager (twice), a process."""
    return run_ranks(dcp_workers.async_many, 2, root)


@pytest.fixture(scope="module")
def async_loaded(root, async_saved):
    return run_ranks(dcp_workers.load_async, 4, root)


def assert_same(result, reference, where):
    assert result["state"].keys() == reference["state"].keys(), where
    for key, value in result["state"].items():
        assert torch.equal(value, reference["state"][key]), f"{key} differs ({where})"
    assert torch.equal(result["output"], reference["output"]), where


def test_dcp_save_4_then_dcp_load_3_is_bit_exact_with_stateful_bytes_and_objects(saved, loaded):
    for rank, result in enumerate(loaded):
        assert_same(result["dcp"], saved[0]["dcp"], f"4 -> 3, rank {rank}")
        n, t = result["dcp"]["counter"]
        assert n == 3 and torch.equal(t, torch.full((3,), 3.0))
        assert result["dcp"]["blob"] == b"blob-3"
        assert result["dcp"]["opaque"] == "tag-3"


def test_rayckpt_save_and_an_incremental_chain_are_read_by_dcp_load(saved, loaded):
    for rank, result in enumerate(loaded):
        assert_same(result["rayckpt"], saved[0]["rayckpt"], f"rayckpt.save -> dcp.load, rank {rank}")
        assert_same(result["chain/2"], saved[0]["chain"], f"incremental chain -> dcp.load, rank {rank}")
    assert saved[0]["chain-2-info"].bytes_written > 0


def test_the_writer_incremental_shares_unchanged_chunks_and_each_save_loads(root, saved, loaded):
    for i in (1, 2, 3):
        for rank, result in enumerate(loaded):
            assert_same(result[f"dinc/{i}"], saved[0][f"dinc-{i}"], f"incremental {i}, rank {rank}")
    files = [{f.path for f in rayckpt.read_manifest(f"{root}/dinc/{i}").files} for i in (1, 2, 3)]
    assert files[1] == files[0], "the same state again: every chunk is the first save's"
    assert not files[2] & files[0], "after a step every chunk changed: nothing shared"
    assert all(rayckpt.verify(f"{root}/dinc/{i}").ok for i in (1, 2, 3))


def test_rayckpt_load_reads_what_the_writer_wrote_under_another_world_size(saved, loaded):
    for rank, result in enumerate(loaded):
        reference = saved[0]["dcp"]
        assert result["rayckpt.load"]["state"].keys() == reference["state"].keys()
        for key, value in result["rayckpt.load"]["state"].items():
            assert torch.equal(value, reference["state"][key]), f"{key} (rank {rank})"
        assert result["rayckpt.load"]["counter"][0] == 3
        assert result["rayckpt.load"]["blob"] == b"blob-3"


def test_the_writers_checkpoint_loads_into_a_plain_module_in_one_process(root, saved):
    model = ToyModel()
    info = rayckpt.load({"model": model.state_dict()}, f"{root}/dcp", strict=False)
    assert info.missing_keys == ()
    with torch.no_grad():
        assert torch.equal(model(fixed_input()).float(), saved[0]["dcp"]["output"])
    manifest = rayckpt.read_manifest(f"{root}/dcp")
    assert manifest.world_size == 4
    assert manifest.user_metadata["rayckpt.dcp.pickled"] == ["opaque"], "only the object JSON cannot hold is a pickle"
    assert rayckpt.verify(f"{root}/dcp").ok


def test_the_tied_gpt_round_trips_through_dcp_every_logit_equal(saved, loaded):
    for rank, result in enumerate(loaded):
        assert result["gpt"]["tied"], f"rank {rank}: the head is no longer the embedding"
        assert torch.equal(result["gpt"]["logits"], saved[0]["gpt"]), f"rank {rank}"


def test_dcp_reads_only_about_the_bytes_it_needs(loaded):
    for result in loaded:
        info = result["dcp"]["info"]
        assert 0 < info.bytes_needed <= info.bytes_read


@pytest.mark.parametrize("mode", ["thread", "stager", "process"])
def test_async_save_2_then_load_4_is_bit_exact(async_saved, async_loaded, mode):
    for rank, result in enumerate(async_loaded):
        assert_same(result[mode], async_saved[0][mode], f"async {mode}, 2 -> 4, rank {rank}")
        assert result[mode]["counter"][0] == 3
        assert result[mode]["blob"] == b"blob-3"


def test_a_rank_dying_mid_save_commits_nothing_and_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    results = run_ranks(dcp_workers.dying_save_worker, 3, path, allow_failures=True, pg_timeout=30)
    assert results[1].exitcode == 9
    assert all(isinstance(r, str) and r != "saved" for r in (results[0], results[2])), results
    first = rayckpt.read_manifest(path)
    assert rayckpt.verify(path).ok
    assert first.world_size == 3
    names = {f.path for f in first.files}
    assert all(name.startswith(first.save_id) for name in names)
