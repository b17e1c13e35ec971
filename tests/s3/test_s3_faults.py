"""Atomicity and the reliability cases that apply to object storage, on a real S3 endpoint.

The manifest is the commit: one whole-object PUT, so readers see the previous
checkpoint or the new one. Saves run in real processes (``tests/helpers/s3_workers``)
that pause where a test asks and are SIGKILLed or let go; nothing depends on timing.
"""

from __future__ import annotations

import re

import pytest
import torch

import rayckpt
from rayckpt.errors import CheckpointNotFoundError
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.storage.lease import LEASE_PREFIX
from rayckpt.tools import gc
from rayckpt.tools.listing import ls
from tests.helpers import s3_workers
from tests.helpers.concurrent_workers import (
    assert_refused_naming,
    go,
    manifest_of,
    race_two_claims,
    ready,
    result,
    state_of,
)

pytestmark = pytest.mark.slow


def assert_holds(s3_server, rel: str, value: int) -> None:
    """The checkpoint at ``rel`` verifies, loads ``state_of(value)`` bit-exact, and holds only its own objects."""
    uri = s3_server.uri(rel)
    report = rayckpt.verify(uri)
    assert report.ok, report.problems
    manifest = manifest_of(uri)
    assert s3_server.listing(rel) == sorted([MANIFEST_NAME, *manifest.table_files] + [f.path for f in manifest.files])
    out = {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.int64), "step": -1}
    rayckpt.load(out, uri)
    want = state_of(value)
    assert out["step"] == value and torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])


def killed_before_commit(s3_server, s3_env, uri: str, sync: str, name: str) -> str:
    """A save of ``state_of(9)`` to ``uri`` SIGKILLed after writing its shard files, before the manifest."""
    proc = s3_workers.start(s3_env, "save_worker", uri, 9, sync, name, "commit")
    save_id = ready(sync, name)
    proc.kill()
    proc.join()
    return save_id


def test_the_manifest_is_one_put_after_every_shard_file_and_no_directory_markers(s3_server, s3_prefix):
    rel = f"{s3_prefix}/ckpt"
    with open(s3_server.log_path) as f:
        f.seek(0, 2)
        rayckpt.save(state_of(1), s3_server.uri(rel))
        requests = re.findall(r'"(GET|PUT|POST|DELETE|HEAD) (/\S+) HTTP', f.read())
    writes = [(m, p) for m, p in requests if m in ("PUT", "POST") and f"/{rel}/" in p]
    manifest_writes = [(m, p) for m, p in writes if p.split("?")[0].endswith(f"/{rel}/{MANIFEST_NAME}")]
    assert manifest_writes == [("PUT", f"/{s3_server.bucket}/{rel}/{MANIFEST_NAME}")], writes
    commit = writes.index(manifest_writes[0])
    # no directory markers up to the commit (pyarrow leaves one for the prefix when the lease is deleted)
    assert not [p for _, p in writes[:commit] if p.split("?")[0].endswith("/")], writes
    shard_writes = [i for i, (_, p) in enumerate(writes) if p.split("?")[0].endswith(".arrow")]
    assert shard_writes and max(shard_writes) < commit
    # The chunk table (format version 4) is one of them: one PUT, before the manifest names it.
    table = [i for i, (_, p) in enumerate(writes) if p.split("?")[0].endswith("-chunks.arrow")]
    assert len(table) == 1 and writes[table[0]][0] == "PUT" and table[0] < commit
    assert_holds(s3_server, rel, 1)


def test_a_save_killed_before_its_manifest_leaves_the_previous_checkpoint_and_gc_clears_it(
    s3_server, s3_env, s3_prefix, tmp_path
):
    rel = f"{s3_prefix}/ckpt"
    uri = s3_server.uri(rel)
    first = rayckpt.save(state_of(1), uri).save_id
    killed = killed_before_commit(s3_server, s3_env, uri, str(tmp_path), "k")
    left = s3_server.listing(rel)
    assert [n for n in left if n.startswith(killed)] and f"{LEASE_PREFIX}{killed}" in left  # its shards are there
    assert manifest_of(uri).save_id == first  # ... but it never committed
    assert rayckpt.verify(uri).ok
    out = {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.int64), "step": -1}
    rayckpt.load(out, uri)
    assert out["step"] == 1 and torch.equal(out["w"], state_of(1)["w"])
    (entry,) = ls(uri)
    assert entry.status == "committed" and entry.save_id == first

    report = gc(uri)
    assert sorted(f.path for f in report.removed) == sorted(s3_server.uri(f"{rel}/{n}") for n in left if killed in n)
    assert_holds(s3_server, rel, 1)
    rayckpt.save(state_of(2), uri)  # the next save commits over it
    assert_holds(s3_server, rel, 2)


def test_a_save_killed_in_a_new_location_leaves_no_checkpoint_and_gc_removes_everything(
    s3_server, s3_env, s3_prefix, tmp_path
):
    run = f"{s3_prefix}/run"
    rel = f"{run}/rayckpt-step-00000001"
    uri = s3_server.uri(rel)
    killed_before_commit(s3_server, s3_env, uri, str(tmp_path), "k")
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        rayckpt.load({"step": 0}, uri)
    (entry,) = ls(s3_server.uri(run))
    assert entry.status == "incomplete"
    report = gc(s3_server.uri(run))
    assert report.removed and report.directories == 1
    assert not s3_server.exists(rel)


def test_a_save_in_flight_on_s3_refuses_a_second_save_naming_it(s3_server, s3_env, s3_prefix, tmp_path):
    rel, sync = f"{s3_prefix}/ckpt", str(tmp_path)
    uri = s3_server.uri(rel)
    rayckpt.save(state_of(1), uri)
    a = s3_workers.start(s3_env, "save_worker", uri, 2, sync, "a", "commit")
    a_id = ready(sync, "a")  # a's shard files are written, its commit is next
    b = s3_workers.start(s3_env, "save_worker", uri, 3, sync, "b")
    assert_refused_naming(result(sync, "b", b), uri, a_id)
    assert gc(uri).live_saves == (a_id,)  # gc keeps the live save's files
    go(sync, "a")
    assert result(sync, "a", a) == {"ok": True, "save_id": a_id}
    assert_holds(s3_server, rel, 2)


def test_two_saves_claiming_one_s3_location_at_once_let_exactly_one_through(s3_server, s3_env, s3_prefix, tmp_path):
    rel, sync = f"{s3_prefix}/ckpt", str(tmp_path)
    uri = s3_server.uri(rel)
    won = race_two_claims(lambda n, v: s3_workers.start(s3_env, "save_worker", uri, v, sync, n, "claim"), uri, sync)
    assert_holds(s3_server, rel, won)
