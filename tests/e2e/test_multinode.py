"""Several Ray nodes on one machine: each rank's shard is written by its own node's writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def multinode(tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.multinode_job", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "result.json") as f:
        return json.load(f)


def test_each_rank_is_written_by_the_writer_on_its_node(multinode):
    assert set(multinode["rank_nodes"].values()) == set(multinode["worker_nodes"])  # one rank per node
    assert multinode["writer_nodes"] == multinode["rank_nodes"]


def test_node_local_storage_across_nodes_is_refused(multinode):
    msg = multinode["refused"]
    assert msg is not None
    assert "node-local storage but the ranks run on 2 nodes" in msg
    assert "RAYCKPT_LOCAL_IS_SHARED=1" in msg
