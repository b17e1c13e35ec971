"""``rayckpt.save`` / ``load`` on ``s3://``: FSDP2 on gloo ranks, saved by 3, loaded by 2 and by 1, bit-exact."""

from __future__ import annotations

import re
import time

import pytest
import torch

import rayckpt
from rayckpt.examples.demo import load_worker, save_worker
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.planning import range_gets
from rayckpt.storage.checkpoint_dir import CheckpointDir
from rayckpt.testing.multiproc import run_ranks
from rayckpt.testing.toy import ToyModel, fixed_input

pytestmark = pytest.mark.slow


def logged_requests(log, until, timeout_s: float = 30.0) -> list[tuple[str, str]]:
    """(method, path) of the requests the server logs from ``log``'s position on, read until
    ``until(requests)`` holds: the server logs a request once its response is sent, a moment
    after the client has it."""
    text, deadline = "", time.monotonic() + timeout_s
    while True:
        text += log.read()
        requests = re.findall(r'"(?:\x1b\[[0-9;]*m)*(GET|HEAD|PUT|POST|DELETE) (/\S+) HTTP', text)  # 206s are coloured
        if until(requests) or time.monotonic() > deadline:
            return requests
        time.sleep(0.05)


@pytest.fixture(scope="module")
def saved_by_3(s3_server):
    uri = s3_server.uri("fsdp/saved_by_3")
    return uri, run_ranks(save_worker, 3, uri, 2)[0]


def test_three_ranks_save_to_s3_and_two_ranks_load_bit_exact(s3_server, saved_by_3):
    uri, reference = saved_by_3
    names = s3_server.listing("fsdp/saved_by_3")
    manifest = rayckpt.read_manifest(CheckpointDir.resolve(uri))
    assert manifest.world_size == 3
    assert names == sorted(
        [MANIFEST_NAME, *manifest.table_files] + [f.path for f in manifest.files]
    )  # no lease, no temp file left
    for rank, result in enumerate(run_ranks(load_worker, 2, uri)):
        assert result["state"].keys() == reference["state"].keys()
        for key, value in result["state"].items():
            assert torch.equal(value, reference["state"][key]), f"{key} differs on rank {rank} (3->2)"
        assert torch.allclose(result["output"], reference["output"], rtol=1e-5, atol=1e-7)
        assert result["step"] == 2
        assert result["info"].bytes_read >= result["info"].bytes_needed > 0
    assert rayckpt.verify(uri).ok


def test_one_process_loads_the_s3_checkpoint_into_a_plain_module(s3_server, saved_by_3):
    uri, reference = saved_by_3
    model = ToyModel()
    rayckpt.load({"app": {"model": model.state_dict()}}, uri)
    for name, p in model.state_dict().items():
        assert torch.equal(p, reference["state"][f"app.model.{name}"]), name
    assert torch.allclose(model(fixed_input()), reference["output"], rtol=1e-5, atol=1e-7)


def test_a_pyarrow_s3_filesystem_object_works_like_the_uri(s3_server, saved_by_3):
    uri, reference = saved_by_3
    fs = s3_server.filesystem()
    model = ToyModel()
    rayckpt.load({"app": {"model": model.state_dict()}}, s3_server.fs_path("fsdp/saved_by_3"), filesystem=fs)
    for name, p in model.state_dict().items():
        assert torch.equal(p, reference["state"][f"app.model.{name}"]), name
    again = s3_server.fs_path("fsdp/copy")
    rayckpt.save({"model": model.state_dict()}, again, filesystem=fs)
    out = {"model": ToyModel().state_dict()}
    rayckpt.load(out, s3_server.uri("fsdp/copy"))
    for name, p in model.state_dict().items():
        assert torch.equal(out["model"][name], p), name


def is_shard(path: str) -> bool:
    """A request for a shard file (not the manifest's chunk table, read with the manifest)."""
    name = path.split("?")[0]
    return name.endswith(".arrow") and not name.endswith("-chunks.arrow")


def test_a_load_makes_one_head_per_shard_file_and_the_gets_it_reports(s3_server, s3_prefix, monkeypatch):
    """Seen by the server: opening a shard file is its only HEAD (its size comes with it), and the
    ranged GETs of shard bytes are exactly ``LoadInfo.requests``, a large range in parallel parts."""
    monkeypatch.setattr(range_gets, "GET_PART_BYTES", 100_000)
    uri = s3_server.uri(f"{s3_prefix}/ckpt")
    state = {"w": torch.arange(100_000, dtype=torch.float32), "b": torch.arange(10, dtype=torch.int64)}
    rayckpt.save(state, uri)
    files = [f.path for f in rayckpt.read_manifest(CheckpointDir.resolve(uri)).files]
    out = {"w": torch.zeros(100_000), "b": torch.zeros(10, dtype=torch.int64)}
    with open(s3_server.log_path) as log:
        log.seek(0, 2)
        info = rayckpt.load(out, uri)
        requests = logged_requests(log, until=lambda reqs: sum(is_shard(p) for _, p in reqs) >= 2 + 5)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    shard = [(m, p.split("?")[0].rsplit("/", 1)[1]) for m, p in requests if is_shard(p)]
    assert sorted(n for m, n in shard if m == "HEAD") == sorted(files)
    gets = [n for m, n in shard if m == "GET"]
    assert len(gets) == info.requests == 1 + 4  # "b": one GET; "w" (400,000 bytes): 4 parts
