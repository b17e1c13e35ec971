"""Three Ray nodes on one machine saving a TorchTrainer run to S3 and to their memory, each node's writer
writing only its own node's ranks from its own staging directory; then, one node removed, a resume on the
two left with two workers, from the memory they hold. The first run's ranks first check that a save to
node-local storage across nodes is refused."""

from __future__ import annotations

import pytest
import torch

import rayckpt
from tests.helpers.cluster_jobs import run_cluster_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def multinode(s3_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode-s3")
    # The AWS variables of the S3 tier are in this process's environment: the job inherits them.
    args = [s3_server.host_port, s3_server.bucket, "multinode"]
    return run_cluster_job("tests.helpers.multinode_s3_job", out, *args, timeout=540)


def check_writers_wrote_only_their_nodes_ranks(save: dict, shm_dirs: dict[str, str]) -> None:
    """From each ShardWriter's own record of the storage save: it ran on its node, wrote exactly the ranks
    whose workers trained there, each from a staging file created in that node's directory."""
    by_rank = save["rank_nodes"]
    assert len(set(by_rank.values())) == len(by_rank)  # one worker per node
    for node, stats in save["writers"].items():
        assert stats["node"] == node and stats["staging_dir"] == shm_dirs[node]
        writes = [w for w in stats["writes"] if w["save_id"] == save["save_id"]]
        assert sorted(str(w["rank"]) for w in writes) == sorted(r for r, n in by_rank.items() if n == node)
        for w in writes:
            assert (w["node"], w["staged_node"], w["staging"]) == (node, node, "shm")
            assert w["staged_dir"] == shm_dirs[node], (w, node)
            assert w["bytes"] > 0 and w["files"] and all(f"-r{w['rank']:05d}-" in f for f in w["files"])
    assert save["committed"] == by_rank  # the MetadataActor saw the same: rank -> its writer's node


def test_three_nodes_each_write_their_own_ranks_to_s3(multinode):
    shm_dirs = multinode["shm_dirs"]
    assert len(set(shm_dirs.values())) == 3 and multinode["head"] not in shm_dirs
    assert set(multinode["save3"]["rank_nodes"].values()) == set(shm_dirs)  # every worker node trained a rank
    check_writers_wrote_only_their_nodes_ranks(multinode["save3"], shm_dirs)


def test_node_local_storage_across_nodes_is_refused(multinode):
    msg = multinode["refused"]
    assert msg.startswith("InvalidStateError: "), msg
    assert "node-local storage but the ranks run on 3 nodes" in msg
    assert "RAYCKPT_LOCAL_IS_SHARED=1" in msg


def test_resume_on_two_nodes_restores_what_three_saved_and_saves_per_node(multinode, s3_server):
    out = multinode["out"]
    saved = torch.load(out / "final-3.pt", weights_only=False)
    restored = torch.load(out / "restored-2.pt", weights_only=False)
    assert restored["step"] == 2
    for key, value in saved["state"].items():
        assert torch.equal(restored["state"][key], value), key
    save2 = multinode["save2"]
    assert len(set(save2["rank_nodes"].values())) == 2
    check_writers_wrote_only_their_nodes_ranks(save2, multinode["shm_dirs"])
    for step in (2, 3):
        assert rayckpt.verify(s3_server.uri(f"multinode/nodes/rayckpt-step-{step:08d}")).ok


def test_memory_checkpoints_are_held_on_two_nodes_and_restore_after_a_node_is_lost(multinode):
    """The memory tier's replication: every shard file of a memory save is held by its rank's node and by the next
    node of the ring (node ids sorted, by their first 12 characters), sent over the writers' replica link;
    with rank 2's node gone, 2 workers restore the 3 workers' memory checkpoint of step 2 from what the other
    two hold (``test_resume_on_two_nodes_restores_what_three_saved_and_saves_per_node``: bit-exact)."""
    memory = multinode["memory"]
    step2 = "mem/nodes/rayckpt-step-00000002/"
    ring = sorted(memory["held"])
    shards = {}
    for node, files in memory["held"].items():
        for path in files:
            if path.startswith(step2) and path.endswith(".arrow") and "-r0000" in path:
                shards.setdefault(path, set()).add(node)
    ranks = multinode["save3"]["rank_nodes"]
    for rank in ("0", "1", "2"):
        (path,) = [p for p in shards if f"-r{int(rank):05d}-" in p]
        home = ranks[rank]
        successor = ring[(ring.index(home) + 1) % len(ring)]
        assert shards[path] == {home, successor}, (rank, path, shards[path], home, successor)
    # Every replica went writer to writer over the replica link, none through Ray's object store.
    replicated = {p for files in memory["held"].values() for p in files if "-r0" in p and p.endswith(".arrow")}
    assert sum(r["files"] for r in memory["received"].values()) == len(replicated) == 6  # 3 ranks, steps 1 and 2
    assert all(r["files"] > 0 for r in memory["received"].values())
    assert memory["victim"] == ranks["2"]
    assert memory["victim"] not in multinode["save2"]["rank_nodes"].values()
    restored = torch.load(multinode["out"] / "restored-2.pt", weights_only=False)
    assert restored["step"] == 2 and restored["restored_from"]["tier"] == "memory"
