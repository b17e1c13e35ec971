"""FSDP2 (fully_shard) + AdamW on CPU/gloo, saved by N processes and loaded by M."""

from __future__ import annotations

import json
import os

import pytest
import torch

import rayckpt
from rayckpt.examples.demo import save_worker
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.testing.multiproc import run_ranks
from rayckpt.testing.toy import ToyModel, fixed_input
from tests.helpers import workers

pytestmark = pytest.mark.slow
SIZES = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint per save world size N (N=4 with a 4-byte block, so reads can be exact)."""
    root = tmp_path_factory.mktemp("matrix")
    out = {}
    for n in SIZES:
        path = str(root / f"saved_by_{n}")
        results = run_ranks(save_worker, n, path, 3, "float32", 4 if n == 4 else None)
        out[n] = (path, results[0])
    return out


@pytest.fixture(scope="module")
def loaded(saved):
    """Every checkpoint loaded by every world size M: {(N, M): per-rank results}."""
    paths = [saved[n][0] for n in SIZES]
    out = {}
    for m in SIZES:
        per_rank = run_ranks(workers.load_many_worker, m, paths)
        for i, n in enumerate(SIZES):
            out[(n, m)] = [r[i] for r in per_rank]
    return out


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("m", SIZES)
def test_reshard_n_to_m_is_bit_exact(saved, loaded, n, m):
    reference = saved[n][1]
    for rank, result in enumerate(loaded[(n, m)]):
        assert result["state"].keys() == reference["state"].keys()
        for key, value in result["state"].items():
            assert torch.equal(value, reference["state"][key]), f"{key} differs on rank {rank} ({n}->{m})"
        assert torch.allclose(result["output"], reference["output"], rtol=1e-5, atol=1e-7), "outputs MATCH"
        assert result["step"] == 3


def test_saved_state_covers_model_and_optimizer(saved):
    state = saved[2][1]["state"]
    keys = set(state)
    assert any(k.endswith("blocks.0.0.weight") and ".model." in k for k in keys)
    for moment in ("exp_avg", "exp_avg_sq", "step"):
        assert any(k.endswith(f"blocks.0.0.weight.{moment}") for k in keys), moment
    # a real training step happened, so moments are non-zero
    assert any(state[k].abs().sum() > 0 for k in keys if k.endswith("exp_avg"))


def test_dim0_reshard_reads_exactly_the_needed_bytes(loaded):
    # Saved by 4 with a 4-byte checksum block: every block boundary is an element boundary.
    for result in loaded[(4, 3)]:
        info = result["info"]
        assert info.bytes_needed > 0
        assert info.bytes_read == info.bytes_needed


def test_replicated_step_scalars_are_written_once(saved):
    path = saved[4][0]
    manifest = rayckpt.read_manifest(CheckpointDir.resolve(path))
    steps = [k for k in manifest.entries if k.endswith(".step") and ".optim.state." in k]
    assert steps
    for key in steps:
        assert len(manifest.tensor(key).chunks) == 1, key
    # rank 3 holds the fewest rows (uneven dim-0 shards), so the balancer gives it the replicas
    writers = {manifest.tensor(k).chunks[0].file.split("-r")[1][:5] for k in steps}
    assert writers == {"00003"}


def test_plain_module_in_one_process_loads_a_4_rank_checkpoint(saved):
    path = saved[4][0]
    model = ToyModel()
    before = model(fixed_input())
    rayckpt.load({"app": {"model": model.state_dict()}}, path)
    after = model(fixed_input())
    assert not torch.allclose(before, after)
    assert torch.allclose(after, saved[4][1]["output"], rtol=1e-5, atol=1e-7)
    for name, p in model.state_dict().items():
        assert torch.equal(p, saved[4][1]["state"][f"app.model.{name}"])


def test_raw_dtensor_state_dict_round_trip(tmp_path):
    path = str(tmp_path / "raw")
    saved = run_ranks(workers.raw_dtensor_worker, 3, path, "save")
    loaded = run_ranks(workers.raw_dtensor_worker, 2, path, "load")
    for key, value in saved[0]["full"].items():
        assert torch.equal(loaded[0]["full"][key], value), key
    assert torch.allclose(loaded[1]["output"], saved[0]["output"])


def test_bf16_params_round_trip(tmp_path):
    path = str(tmp_path / "bf16")
    saved = run_ranks(save_worker, 2, path, 2, "bfloat16")
    manifest = rayckpt.read_manifest(CheckpointDir.resolve(path))
    assert manifest.tensor("app.model.head.weight").dtype == "bfloat16"
    loaded = run_ranks(workers.load_worker, 3, path, "bfloat16")
    for key, value in saved[0]["state"].items():
        assert value.dtype == loaded[2]["state"][key].dtype
        assert torch.equal(loaded[2]["state"][key], value), key


def test_stateful_app_state_round_trips(tmp_path):
    path = str(tmp_path / "app")
    saved = run_ranks(workers.app_state_worker, 2, path, "save")
    loaded = run_ranks(workers.app_state_worker, 2, path, "load")
    for s, r in zip(saved, loaded):
        assert r["sched"] == s["sched"]
        assert r["lr"] == s["lr"]
        assert r["counter"] == s["counter"] and r["counter"]["n"] == 3
        assert r["step"] == 3
        assert torch.equal(r["rng"], s["rng"])
        assert r["tag"] == "run-a"
    assert not torch.equal(saved[0]["rng"], saved[1]["rng"])  # per-rank keys kept apart


def test_hsdp_save_writes_the_replicated_dim_once(tmp_path):
    path = str(tmp_path / "hsdp")
    saved = run_ranks(workers.hsdp_save_worker, 4, path)
    manifest = rayckpt.read_manifest(CheckpointDir.resolve(path))
    weight = manifest.tensor("app.model.blocks.0.0.weight")
    assert len(weight.chunks) == 2  # shard dim of 2, not 4 copies
    state_bytes = sum(v.numel() * v.element_size() for v in saved[0]["state"].values())
    stored = sum(c.byte_length for e in manifest.entries.values() if hasattr(e, "chunks") for c in e.chunks)
    assert stored == state_bytes  # every element stored exactly once
    loaded = run_ranks(workers.load_worker, 3, path)
    for key, value in saved[0]["state"].items():
        assert torch.equal(loaded[0]["state"][key], value), key
    assert torch.allclose(loaded[2]["output"], saved[0]["output"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("where", ["state", "write"])
def test_rank_failing_mid_save_commits_nothing_and_keeps_previous(tmp_path, where):
    path = str(tmp_path / "ckpt")
    first = run_ranks(save_worker, 3, path)
    manifest_before = open(os.path.join(path, "manifest.json")).read()
    files_before = workers.files_in(path)
    messages = run_ranks(workers.failing_save_worker, 3, path, where)
    for rank, msg in enumerate(messages):
        assert msg.startswith("SaveFailedError"), (rank, msg)
        assert "rank 1" in msg
        assert ("dataloader state unavailable" if where == "state" else "No space left on device") in msg
    assert open(os.path.join(path, "manifest.json")).read() == manifest_before
    assert workers.files_in(path) == files_before  # partial files removed
    loaded = run_ranks(workers.load_worker, 2, path)
    for key, value in first[0]["state"].items():
        assert torch.equal(loaded[0]["state"][key], value)
    assert json.loads(manifest_before)["world_size"] == 3


def test_stateful_callbacks_run_in_the_same_order_on_every_rank(tmp_path):
    # Rank 0 holds {alpha, beta}, rank 1 {beta, alpha}; each state_dict() and
    # load_state_dict() all-reduces its object's ident. In dict order the ranks would
    # pair alpha with beta (sum 101); in a common order each sums its own ident twice.
    results = run_ranks(workers.stateful_order_worker, 2, str(tmp_path / "ck"), timeout=120)
    assert [r["order"] for r in results] == [["alpha", "beta"], ["beta", "alpha"]]
    for r in results:
        assert r["save"] == {"alpha": 2, "beta": 200}
        assert r["load"] == {"alpha": 2, "beta": 200}
        assert r["weights"] == {"alpha": [1.0] * 4, "beta": [100.0] * 4}


def test_overwrite_false_refuses_on_every_rank_and_keeps_the_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    messages = run_ranks(workers.overwrite_refused_worker, 2, path, timeout=120)
    assert all("already holds a committed checkpoint and overwrite=False" in m for m in messages), messages
    out = {"w": torch.empty(8)}
    rayckpt.load(out, path)
    assert torch.equal(out["w"], torch.full((8,), 7.0))  # rank 0's first save, not overwritten


def test_a_legacy_sharded_tensor_is_refused_by_key_and_type(tmp_path):
    (result,) = run_ranks(workers.sharded_tensor_worker, 1, str(tmp_path / "ck"), timeout=120)
    assert not result["written"]
    assert result["error"] and result["error"].startswith("key 'legacy': ShardedTensor (the legacy")
