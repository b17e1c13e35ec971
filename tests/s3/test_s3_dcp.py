"""``dcp.save`` / ``dcp.load`` with rayckpt's writer and reader on ``s3://``: FSDP2 + AdamW on gloo ranks, 2 -> 3.

Read amplification at scale (bytes fetched against bytes needed): the suite benchmark, docs/benchmarks.md."""

from __future__ import annotations

import pytest
import torch

import rayckpt
from rayckpt.testing.multiproc import run_ranks
from tests.helpers import dcp_workers

pytestmark = pytest.mark.slow


def assert_read_as_rayckpt_load_reads(info, own, where):
    """The reader's plan is rayckpt.load's: the same bytes needed, the same block-aligned ranged GETs."""
    assert info.bytes_needed == own.bytes_needed > 0, where
    assert (info.bytes_fetched, info.requests) == (own.bytes_fetched, own.requests), where


def test_a_rayckpt_save_on_s3_is_read_by_dcp_load_ranged_and_verified(s3_server):
    uri = s3_server.uri("dcp/rayckpt")
    reference = run_ranks(dcp_workers.rayckpt_save_worker, 2, uri)[0]
    own = run_ranks(dcp_workers.rayckpt_info_worker, 3, uri)
    for rank, result in enumerate(run_ranks(dcp_workers.plain_load_worker, 3, uri)):
        for key, value in result["state"].items():
            assert torch.equal(value, reference["state"][key]), f"{key} differs on rank {rank} (2 -> 3)"
        assert torch.equal(result["output"], reference["output"])
        assert_read_as_rayckpt_load_reads(result["info"], own[rank], f"rank {rank}")


def test_dcp_save_with_the_writer_on_s3_commits_a_rayckpt_checkpoint_dcp_load_reads(s3_server):
    uri = s3_server.uri("dcp/writer")
    reference = run_ranks(dcp_workers.save_worker, 2, uri)[0]
    assert rayckpt.verify(uri).ok
    leases = [n for n in s3_server.listing("dcp/writer") if n.startswith(".rayckpt-lease-")]
    assert not leases, "no lease left after the commit"
    for rank, result in enumerate(run_ranks(dcp_workers.load_worker, 3, uri)):
        for key, value in result["state"].items():
            assert torch.equal(value, reference["state"][key]), f"{key} differs on rank {rank} (2 -> 3)"
        assert result["blob"] == b"blob-3" and result["opaque"] == "tag-3"
        assert result["info"].bytes_fetched >= result["info"].bytes_needed > 0
