"""A 3-node Ray cluster on this machine (ray.cluster_utils.Cluster), run as a subprocess.

Usage: python -m tests.helpers.multinode_job OUT_DIR. Writes OUT_DIR/result.json.
"""

from __future__ import annotations

import json
import os
import sys

import ray
from ray.cluster_utils import Cluster
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from rayckpt.ray.metadata_actor import get_metadata_actor

from . import ray_workers


def fit(storage: str, out: str, name: str, **config) -> None:
    TorchTrainer(
        ray_workers.toy_train_loop,
        train_loop_config={"steps": 2, "save_at": {2}, "out": out, **config},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, "slot": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=name, storage_path=storage),
    ).fit()


def main(out: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=1, resources={"slot": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="rayckpt-multinode")
    storage = os.path.join(out, "storage")
    result: dict = {"worker_nodes": sorted(n.node_id for n in nodes)}
    try:
        fit(storage, out, "local-refused")
        result["refused"] = None
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        result["refused"] = str(exc)
    fit(storage, out, "shared", local_is_shared=True)
    events = ray.get(get_metadata_actor().events.remote("shared"))
    committed = [e for e in events if e["kind"] == "committed"]
    result["writer_nodes"] = {str(k): v for k, v in committed[-1]["writer_nodes"].items()}
    result["rank_nodes"] = {str(r): open(os.path.join(out, f"node-2-{r}.txt")).read() for r in range(2)}
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
