"""Three Ray worker nodes on this machine saving to S3 and to their memory, then, one node removed, a resume
on two from the memory left; run as a subprocess.

Usage: python -m tests.helpers.multinode_s3_job OUT_DIR HOST:PORT BUCKET PREFIX. Writes OUT_DIR/result.json.
The first run's ranks first save to a node-local directory, which must be refused.

A ``ray.cluster_utils.Cluster``: a head with 1 CPU and no ``slot`` (no training
worker lands there) and three nodes with 1 CPU and 1 ``slot`` each, so a worker
asking for a slot runs one per node. Each node's raylet gets its own
``RAYCKPT_SHM_DIR`` (``Cluster.add_node(env_vars=...)``), which the processes it
starts (training workers, the node's ShardWriter) inherit: each node stages in
its own directory. They are plain directories under OUT_DIR, not tmpfs: the
staging buffer needs only ``posix_fallocate`` and a shared ``mmap``, which any
local filesystem gives, and the test needs distinct namespaces, not RAM.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pyarrow.fs as pafs
import ray
from ray.cluster_utils import Cluster
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from rayckpt.ray.actors import NAMESPACE, writer_name
from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.ray.shm import SHM_DIR_ENV

from . import ray_workers

RUN = "nodes"


def fit(
    storage: str, fs: Any, out: str, workers: int, steps: int, save_at: set[int], name: str = RUN, **extra: Any
) -> None:
    TorchTrainer(
        ray_workers.toy_train_loop,
        train_loop_config={"steps": steps, "save_at": save_at, "out": out, **extra},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1, "slot": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=name, storage_path=storage, storage_filesystem=fs),
    ).fit()


def writer(node_id: str) -> Any:
    return ray.get_actor(writer_name(node_id), namespace=NAMESPACE)


def writers(node_ids: list[str]) -> dict[str, dict]:
    """Each node's ShardWriter's own record (``debug_stats``), by the node id it was looked up for."""
    return {n: ray.get(writer(n).debug_stats.remote()) for n in node_ids}


def storage_save(node_ids: list[str], ranks: dict[str, str], step: int) -> dict[str, Any]:
    """The storage save of ``step`` (the MetadataActor's ``committed`` event of the run; its memory saves are
    the run ``nodes@memory``'s): its id, the node whose writer wrote each rank, each node's ShardWriter's record
    and the node each rank trained on."""
    events = ray.get(get_metadata_actor().events.remote(RUN))
    (event,) = [e for e in events if e["kind"] == "committed" and e.get("step") == step]
    return {
        "save_id": event["save_id"],
        "committed": {str(k): v for k, v in event["writer_nodes"].items()},
        "writers": writers(node_ids),
        "rank_nodes": ranks,
    }


def rank_nodes(out: str, world: int) -> dict[str, str]:
    """The node each rank of a ``world``-worker run trained on (written by ``toy_train_loop``)."""
    return {str(r): open(os.path.join(out, f"node-{world}-{r}.txt")).read() for r in range(world)}


def main(out: str, host_port: str, bucket: str, prefix: str) -> None:
    fs = pafs.S3FileSystem(
        endpoint_override=host_port,
        scheme="http",
        access_key=os.environ["AWS_ACCESS_KEY_ID"],
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region=os.environ["AWS_REGION"],
    )
    storage = f"{bucket}/{prefix}"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    shm_dirs = [os.path.join(out, f"shm-{i}") for i in range(3)]
    nodes = []
    for d in shm_dirs:
        os.makedirs(d)
        nodes.append(cluster.add_node(num_cpus=1, resources={"slot": 1}, env_vars={SHM_DIR_ENV: d}))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="rayckpt-multinode-s3")
    ids = [n.node_id for n in nodes]
    result: dict[str, Any] = {"shm_dirs": dict(zip(ids, shm_dirs)), "head": cluster.head_node.node_id}

    # One worker per node. First each saves to a node-local directory, refused with ranks on several nodes
    # (this machine's disk: not shared). Then steps 1 and 2 go to the nodes' memory (each shard file also on
    # the next node of the ring), and step 2 to S3 too.
    fit(storage, fs, out, 3, 2, {2}, memory_every=1, probe_local=os.path.join(out, "local"))
    result["refused"] = open(os.path.join(out, "refused.txt")).read()
    result["save3"] = storage_save(ids, rank_nodes(out, 3), 2)
    held = {n: ray.get(writer(n).mem_listing.remote(f"mem/{RUN}", True)) for n in ids}
    received = {n: stats["replicas_received"] for n, stats in result["save3"]["writers"].items()}
    (victim,) = [n for n in nodes if n.node_id == result["save3"]["rank_nodes"]["2"]]
    cluster.remove_node(victim)
    result["memory"] = {"held": held, "victim": victim.node_id, "received": received}

    # The resume on the two nodes left, two workers: step 2 restored from the memory the other two hold (rank
    # 2's files from its ring successor), step 3 saved to S3 (and memory) by each node's writer.
    kept = [n.node_id for n in nodes if n is not victim]
    fit(storage, fs, out, 2, 3, {3}, memory_every=1)
    result["save2"] = storage_save(kept, rank_nodes(out, 2), 3)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
