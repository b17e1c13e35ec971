"""The training job's model and data, single process: sizes, determinism, rank slices, learning."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rayckpt.examples.gpt import GPT, GPTConfig, synthetic_batch
from rayckpt.examples.gpt_job import (
    parse_args,
    restart_line,
    train_config,
    warmup_cosine,
    worker_resources,
    workers_asked,
)


def test_preset_sizes():
    assert 20_000_000 <= GPT(GPTConfig()).num_params() <= 30_000_000
    assert 80_000 <= GPT(GPTConfig.tiny()).num_params() <= 150_000


def test_tied_head_shares_the_embedding():
    cfg = dataclasses.replace(GPTConfig.tiny(), tie_head=True)
    model = GPT(cfg)
    assert model.head.weight is model.tok_emb.weight
    assert model.num_params() == GPT(GPTConfig.tiny()).num_params() - cfg.vocab_size * cfg.d_model


def test_config_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        GPTConfig(d_model=100, n_heads=3)


def test_forward_shape_and_no_dropout():
    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    model = GPT(cfg).train()
    tokens, _ = synthetic_batch(0, 4, cfg)
    out = model(tokens)
    assert out.shape == (4, cfg.seq_len, cfg.vocab_size)
    assert torch.equal(out, model(tokens)), "a training-mode forward is deterministic"


SMALL = GPTConfig(vocab_size=64, seq_len=16)
TINY = GPTConfig(vocab_size=50, seq_len=8)


def test_synthetic_batch_is_a_function_of_seed_and_step():
    a = synthetic_batch(3, 12, SMALL)
    b = synthetic_batch(3, 12, SMALL)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], synthetic_batch(4, 12, SMALL)[0])
    assert not torch.equal(a[0], synthetic_batch(3, 12, SMALL, seed=1)[0])
    inputs, targets = a
    assert inputs.shape == targets.shape == (12, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1]), "targets are the inputs shifted by one"
    assert int(inputs.max()) < 64 and int(inputs.min()) >= 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_rank_slices_partition_the_global_batch(world_size):
    whole_in, whole_tg = synthetic_batch(7, 12, TINY)
    for rank in range(world_size):
        inputs, targets = synthetic_batch(7, 12, TINY, rank, world_size)
        assert inputs.shape == (12 // world_size, 8)
        assert torch.equal(inputs, whole_in[rank::world_size])
        assert torch.equal(targets, whole_tg[rank::world_size])


def test_uneven_global_batch_is_refused():
    with pytest.raises(ValueError, match="global batch 12 is not divisible by 5 workers"):
        synthetic_batch(0, 12, TINY, rank=0, world_size=5)
    with pytest.raises(ValueError, match="rank 4 is not in a world of 4"):
        synthetic_batch(0, 12, TINY, rank=4, world_size=4)


def test_mean_of_equal_rank_slices_is_the_global_loss():
    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        whole = model.loss(*synthetic_batch(0, 12, cfg))
        for world_size in (2, 3, 4):
            parts = [model.loss(*synthetic_batch(0, 12, cfg, r, world_size)) for r in range(world_size)]
            assert torch.allclose(torch.stack(parts).mean(), whole, atol=1e-6)


def test_loss_decreases_with_plain_training():
    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        loss = model.loss(*synthetic_batch(step, 12, cfg))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


def test_warmup_then_cosine():
    factor = warmup_cosine(20)
    assert factor(0) == pytest.approx(0.5)
    assert factor(1) == pytest.approx(1.0)
    assert [factor(s) >= factor(s + 1) for s in range(1, 20)] == [True] * 19
    assert factor(20) == pytest.approx(0.1)


def test_parse_args_defaults_and_checks(tmp_path):
    args = parse_args(["--storage-path", "rel/dir"])
    assert args.num_workers == 4 and args.steps == 20 and args.checkpoint_every == 5
    assert args.global_batch == 12 and not args.resume and not args.gpus
    assert args.storage_path.endswith("rel/dir") and args.storage_path.startswith("/")
    assert parse_args(["--storage-path", "s3://bucket/runs"]).storage_path == "s3://bucket/runs"
    model = train_config(parse_args(["--d-model", "64", "--n-heads", "4"]))["model"]
    GPTConfig(**model)
    assert model["d_ff"] == 256
    with pytest.raises(SystemExit):
        parse_args(["--num-workers", "5"])


def test_worker_counts_and_failures_go_to_ray_train_as_asked():
    fixed = parse_args(["--num-workers", "3"])
    assert (fixed.min_workers, fixed.num_workers, workers_asked(fixed)) == (3, 3, 3)
    elastic = parse_args(["--num-workers", "2-4"])
    assert (elastic.min_workers, elastic.num_workers, workers_asked(elastic)) == (2, 4, (2, 4))
    assert parse_args([]).max_failures == 3  # a failure is recovered from by default
    assert parse_args(["--max-failures", "-1"]).max_failures == -1


def test_rank_0_says_from_which_step_and_with_how_many_workers_a_restart_resumed():
    assert restart_line(2, 6, 3, {"metrics": {"world_size": 4}}) == (
        "restart 2: resumed from step 6 (saved by 4) with 3 worker(s)"
    )
    assert restart_line(1, 6, 4, {}) == "restart 1: resumed from step 6 with 4 worker(s)"
    assert restart_line(1, None, 4, {}) == "restart 1: no committed checkpoint yet: from step 0 with 4 worker(s)"


def test_cpu_workers_share_a_small_cluster():
    assert worker_resources(parse_args(["--num-workers", "4"]), cluster_cpus=2) == {"CPU": 0.5}
    assert worker_resources(parse_args(["--num-workers", "4"]), cluster_cpus=16) is None
    assert worker_resources(parse_args(["--num-workers", "4", "--gpus"]), cluster_cpus=2) is None
    assert worker_resources(parse_args(["--cpus-per-worker", "2"]), cluster_cpus=2) == {"CPU": 2.0}
