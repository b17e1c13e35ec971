"""An FSDP2 4 -> 3 reshard through a remote-looking filesystem: coalesced, counted, bounded, exact GETs."""

from __future__ import annotations

import pytest
import torch

from rayckpt.planning.range_gets import GET_CONCURRENCY, MAX_GAP_FRACTION
from rayckpt.testing.multiproc import run_ranks
from tests.helpers.range_workers import counted_load_worker, save_worker

pytestmark = pytest.mark.slow


def test_fsdp_reshard_4_to_3_fetches_what_the_coalesced_plan_says(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_worker, 4, path)[0]
    loaded = run_ranks(counted_load_worker, 3, path)
    for r in loaded:
        assert r["state"].keys() == saved.keys()
        assert all(torch.equal(r["state"][k], v) for k, v in saved.items())
        info = r["info"]
        # The filesystem saw exactly the coalesced plan's GETs and bytes, and LoadInfo says so.
        assert r["requests"] == info.requests == r["gets"] < info.num_reads
        assert r["bytes"] == info.bytes_fetched == r["get_bytes"]
        # Coalescing adds at most MAX_GAP_FRACTION to the plan's block-aligned ranges.
        assert info.bytes_read <= info.bytes_fetched <= (1 + MAX_GAP_FRACTION) * info.bytes_read
        assert info.read_amplification <= 1.05  # the reads cover the needed bytes, no more
        assert 1 <= r["max_in_flight"] <= GET_CONCURRENCY
