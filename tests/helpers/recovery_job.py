"""TorchTrainer runs that lose a worker, a ShardWriter or a node, on one Ray ``Cluster``; run as a subprocess.

Usage: ``python -m tests.helpers.recovery_job OUT_DIR [SCENARIO ...]``, in the environment ``ENV``.
Writes ``OUT_DIR/result.json``; each scenario's dumps (``ray_workers.toy_train_loop``'s) go to
``OUT_DIR/<scenario>/`` and its checkpoints to ``OUT_DIR/storage/<scenario>/`` (the run is named
after the scenario).

The cluster: a head with 1 CPU (the driver, Ray Train's controllers, the MetadataActor) and four
nodes of 2 CPUs, two with one ``slot_a`` and two with one ``slot_b``; every worker asks for a CPU
and its lane's slot, so a lane's workers run one per node (a group that lost a node cannot fit on
the other). The fixed scenarios run ``FIXED_WORKERS`` (2) workers, one on each of their lane's two
nodes (so a rank's ShardWriter is not the other rank's); the elastic run 1 or 2. Two lanes of
scenarios run side by side, each on its own two nodes (much of a run is waiting on Ray Train's
restarts). Each node's raylet gets its own ``RAYCKPT_SHM_DIR`` (as in ``multinode_s3_job``).
Storage is one local directory that every node reaches (one machine): ``RAYCKPT_LOCAL_IS_SHARED=1``
for every process.

Scenarios, each its own ``fit()``. A worker group start costs most of a run (every worker process
imports torch and joins the group; 25-40 s for 4 workers on 2 cores): what the fixed scenarios
check needs two ranks, not four; the elastic one changes the worker count, 2 -> 1 -> 2; the faults
of one worker count follow each other in one run, one per attempt.

- ``baseline``: uninterrupted, 12 steps, a save every 3; dumps its state at each save too.
- ``chain``: the same run, rank 1 the victim, Ray Train restarting it after each of four faults
  (``CHAIN``, one per attempt): rank 1 dies before step 4 (step 3 committed and reported:
  ``between``); dies staging its share of step 6 (``staging``); dies after its step-9 save
  returned, its ShardWriter blocked writing it (``in_flight``); kills its node's ShardWriter at
  the same moment of step 12's save (``writer``). The fifth attempt finishes.
- ``elastic``: ``num_workers=(1, 2)`` (``ELASTIC_WORKERS``), one per node, 9 steps, saves at 3, 6
  and 9. After step 3 committed the driver removes a node (a crash: its processes SIGKILLed): Ray
  Train restarts with 1 worker, restoring 2 -> 1. After step 6 committed it adds a node back: Ray
  Train grows the group at its next resize check and 2 workers restore 1 -> 2 and finish.

For ``in_flight`` and ``writer`` the run's storage is a ``gated_fs`` filesystem gating step 9's
and step 12's checkpoints, each at its own gate: their shard files wait at the gate until the
attempt after the fault opens it, so the killed save is deterministically in flight.
Checkpointers commit within 300 s: a save settled faster than that was settled by the rollback
(a rank's report or ``RayckptCallback``), not the timeout.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any

import ray
from ray.cluster_utils import Cluster
from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import _AutoscalingCoordinatorActor
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.ray.shm import SHM_DIR_ENV
from rayckpt.ray.writer.actor import get_shard_writer
from rayckpt.storage.catalog import checkpoint_dir_name
from rayckpt.train.callback import RayckptCallback

from . import ray_workers
from .gated_fs import gated_filesystem
from .ray_head import free_ports
from .recovery_faults import wait_until

#: Steps and saves of the fixed scenarios (baseline, chain) and of the elastic one.
STEPS, SAVE_AT = 12, [3, 6, 9, 12]
ELASTIC_STEPS, ELASTIC_SAVE_AT = 9, [3, 6, 9]
#: The elastic run's fewest and most workers (a worker group start is most of a run's time).
ELASTIC_WORKERS = (1, 2)
#: Long enough that only a rollback, never the timeout, settles a killed save within the test.
COMMIT_TIMEOUT_S = 300.0
#: The chain's faults, one per attempt, in order: phase -> the step it strikes (rank 1 each time).
CHAIN = {"between": 4, "staging": 6, "in_flight": 9, "writer": 12}
#: Phase -> the step its restarted attempt restores (the newest checkpoint committed before it).
RESTORES = {"between": 3, "staging": 3, "in_flight": 6, "writer": 9}
#: The phases whose save is held at a gate, in flight, when the fault strikes.
GATED = ("in_flight", "writer")
#: The worker count of the fixed scenarios (the baseline's too: the others end bit-identical to it).
FIXED_WORKERS = 2
#: The two lanes of scenarios that run side by side, each on two nodes with its own resource: lane A
#: in the main thread (the elastic run, last, changes its nodes: Ray does that only from the main
#: thread), lane B in the background. The chain takes about as long as the other two.
LANE_A, SLOT_A = ["baseline", "elastic"], "slot_a"
LANE_B, SLOT_B = ["chain"], "slot_b"
NODE = {"num_cpus": 2, "object_store_memory": 150 * 1024 * 1024}
#: The environment the job runs in (tests/recovery gives it; so must a run by hand).
ENV = {
    # Every node runs on this machine: its local disk is the storage they share.
    "RAYCKPT_LOCAL_IS_SHARED": "1",
    # Ray's default node address is this machine's network address; this makes it loopback.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray Train's controller polls its workers this often (default 2 s): how soon it sees a worker die,
    # a report, the end of a run.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # Just after a node died Ray Train may try a worker count its stale view of the cluster allows;
    # the placement group then waits this long (default 60 s) before it tries again, without counting
    # a failure.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",
    "OMP_NUM_THREADS": "1",
}
# Ray notices a node that stopped answering after health_check_failure_threshold missed checks,
# one per health_check_period_ms (defaults: 5 x 3 s, plus the timeouts): the elastic scenario's
# crashed node would take ~15-30 s to be declared dead. Checks every 0.5 s, 3 misses: ~2 s.
HEAD_SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


class PromptCoordinator(_AutoscalingCoordinatorActor):
    """Ray's ``AutoscalingCoordinator``, looking at the cluster's nodes every second instead of every 20 s.

    Ray Train's elastic policy sizes the worker group from what this actor last saw of the nodes, which it
    looks at once per ``TICK_INTERVAL_S``: a node lost or added counted up to 20 s late (a restart first
    trying the lost node's workers, a grow waiting). Timing only: the decisions are Ray Train's own.
    """

    TICK_INTERVAL_S = 1


def start_prompt_coordinator() -> None:
    """Make ``PromptCoordinator`` under the name and options Ray Train's ``get_or_create`` uses, before any run:
    every run then gets it (``get_if_exists``). Should a Ray release rename it, Ray Train makes its own and the
    elastic run only waits longer."""
    ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(PromptCoordinator).options(
        name="AutoscalingCoordinator",
        namespace="AutoscalingCoordinator",
        get_if_exists=True,
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
    ).remote()


def train_config(out: str, name: str, steps: int = STEPS, save_at: list[int] = SAVE_AT, **extra: Any) -> dict[str, Any]:
    scenario_out = os.path.join(out, name)
    os.makedirs(scenario_out)
    # Self-contained saves: the gated storage holds a save by its checkpoint directory's name, and the
    # scenarios count each checkpoint's own files (incremental saves under faults: tests/faults, tests/ray).
    config = {"steps": steps, "save_at": save_at, "out": scenario_out, "commit_timeout_s": COMMIT_TIMEOUT_S}
    return {**config, "incremental": False, **extra}


def fit(name: str, config: dict[str, Any], storage: str, scaling: ScalingConfig, fs: Any = None) -> None:
    TorchTrainer(
        ray_workers.toy_train_loop,
        train_loop_config=config,
        scaling_config=scaling,
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            storage_filesystem=fs,
            callbacks=[RayckptCallback()],
            failure_config=FailureConfig(max_failures=len(CHAIN)),
        ),
    ).fit()


def worker_scaling(workers: int | tuple[int, int], slot: str, placement: str = "PACK") -> ScalingConfig:
    return ScalingConfig(
        num_workers=workers,
        resources_per_worker={"CPU": 1, slot: 1},
        placement_strategy=placement,
        elastic_resize_monitor_interval_s=2.0,
    )


def run_fixed(out: str, storage: str, name: str, slot: str) -> None:
    if name == "baseline":
        extra: dict[str, Any] = {"dump_saves": True}
        fs = None
    else:
        gates = {p: os.path.join(out, f"gate-{p}") for p in GATED}
        die = [{"rank": 1, "step": step, "phase": p, "gate": gates.get(p)} for p, step in CHAIN.items()]
        extra = {"die": die}
        fs = gated_filesystem({checkpoint_dir_name(CHAIN[p]): gate for p, gate in gates.items()})
    fit(name, train_config(out, name, **extra), storage, worker_scaling(FIXED_WORKERS, slot, "SPREAD"), fs)


class FitThread(threading.Thread):
    """A ``fit()`` in the background: the main thread drives the cluster meanwhile (Ray starts a
    node only from the main thread, as it installs signal handlers)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(daemon=True)
        self.args = args
        self.error: str | None = None

    def run(self) -> None:
        try:
            fit(*self.args)
        except Exception:  # noqa: BLE001 - reported in result.json, where the test shows it
            self.error = traceback.format_exc()


def run_elastic(out: str, storage: str, cluster: Cluster, victim: Any, slot: str) -> dict[str, Any]:
    """Remove ``victim`` once 2 workers hold after step 3; add a node once 1 worker holds after step 6
    (the markers ``recovery_faults.Faults`` writes); wait for the run to end. Main thread only."""
    fewest, most = ELASTIC_WORKERS
    config = train_config(out, "elastic", ELASTIC_STEPS, ELASTIC_SAVE_AT, hold={str(most): 3, str(fewest): 6})
    held = os.path.join(config["out"], "held-{}.json")
    run = FitThread("elastic", config, storage, worker_scaling(ELASTIC_WORKERS, slot, "SPREAD"))
    run.start()
    times, added = {}, None
    alive = run.is_alive
    wait_until(lambda: os.path.exists(held.format(most)) or not alive(), f"{most} workers holding after step 3", 300)
    if alive():
        times["removed"] = time.time()
        cluster.remove_node(victim, allow_graceful=False)  # a crash: its processes SIGKILLed
        wait_until(lambda: os.path.exists(held.format(fewest)) or not alive(), f"{fewest} holding after step 6", 300)
    if alive():
        times["added"] = time.time()
        added = add_node(cluster, out, slot, "added").node_id
    run.join()
    return {"node_times": times, "error": run.error, "added_node": added}


class AddressFile:
    """Ray's ``ray_current_cluster`` file as it was before this job: ``Cluster()`` writes its own
    address there, where a plain ``ray.init()`` of another process on this machine would find and
    join it, and ``Cluster.shutdown()`` deletes the file. Put back what was there, each time."""

    def __init__(self) -> None:
        from ray._common.utils import get_ray_address_file

        self.path = get_ray_address_file(None)
        self.before = self._read()

    def _read(self) -> str | None:
        try:
            with open(self.path) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def put_back(self, ours: str) -> None:
        now = self._read()
        if now not in (ours, None) or now == self.before:
            return  # another process wrote its own since: theirs stays
        if self.before is None:
            os.remove(self.path)
        else:
            with open(self.path, "w") as f:
                f.write(self.before)


def writer_pids(node_ids: list[str]) -> dict[str, int]:
    """The pid of each live node's ShardWriter (made if it is gone)."""
    return {n: ray.get(get_shard_writer(n).__ray_call__.remote(lambda w: os.getpid())) for n in node_ids}


def add_node(cluster: Cluster, out: str, slot: str, name: str) -> Any:
    """A training node: 2 CPUs, one ``slot``, its own staging directory ``OUT_DIR/shm-<slot>-<name>``."""
    shm = os.path.join(out, f"shm-{slot}-{name}")
    os.makedirs(shm)
    return cluster.add_node(**NODE, resources={slot: 1}, env_vars={SHM_DIR_ENV: shm})


def run_scenario(name: str, out: str, storage: str, cluster: Cluster, nodes: list[Any], slot: str) -> dict[str, Any]:
    """One scenario on ``nodes`` (those with ``slot``): its outcome, time and MetadataActor events."""
    entry: dict[str, Any] = {"error": None, "began": time.time()}
    try:
        if name == "elastic":
            entry.update(run_elastic(out, storage, cluster, nodes[1], slot))
        else:
            run_fixed(out, storage, name, slot)
    except Exception:  # noqa: BLE001 - the test shows it; the other scenarios still run
        entry["error"] = traceback.format_exc()
    entry["seconds"] = time.time() - entry["began"]
    entry["events"] = ray.get(get_metadata_actor().events.remote(name))
    if name == "chain":
        entry["writer_pids"] = writer_pids([n.node_id for n in nodes])
    return entry


class Lane(threading.Thread):
    """Scenarios run one after another in the background, on their own nodes."""

    def __init__(self, names: list[str], *args: Any) -> None:
        super().__init__(daemon=True)
        self.names, self.args = names, args
        self.results: dict[str, Any] = {}

    def run(self) -> None:
        for name in self.names:
            self.results[name] = run_scenario(name, *self.args)


def main(out: str, only: list[str]) -> None:
    """Run the scenarios named in ``only`` (default: all), ``LANE_A`` here and ``LANE_B`` beside it."""
    storage = os.path.join(out, "storage")
    gcs_port, api_port = free_ports(2)
    # Ray processes that look their cluster up would otherwise take the newest cluster on this machine,
    # which may be another one: Ray Train's PlacementGroupCleaner, asking that cluster's state API
    # whether its controller lives, would hear "no" and remove this run's placement group. Every
    # process of this cluster inherits its address instead. (This cluster runs no state API: the
    # cleaners then just keep watching, with a warning, until the cluster goes.)
    address = os.environ["RAY_ADDRESS"] = f"127.0.0.1:{gcs_port}"
    address_file = AddressFile()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "gcs_server_port": gcs_port,
            "include_dashboard": False,
            "dashboard_port": api_port,  # unused, but Ray then does not even try its default, another's 8265
            "_system_config": HEAD_SYSTEM_CONFIG,
        },
    )
    address_file.put_back(address)
    result: dict[str, Any] = {}
    try:
        ray.init(address=address, namespace="rayckpt-recovery")
        start_prompt_coordinator()
        result["head"] = cluster.head_node.node_id
        # ``get_metadata_actor`` places it on the head, so the node the elastic run loses cannot take the
        # event log the tests read (nor the commit protocol) with it; the tests check where it is.
        result["metadata_actor_node"] = ray.get(
            get_metadata_actor().__ray_call__.remote(lambda a: ray.get_runtime_context().get_node_id())
        )
        nodes = {slot: [add_node(cluster, out, slot, str(i)) for i in range(2)] for slot in (SLOT_A, SLOT_B)}
        cluster.wait_for_nodes()
        result["nodes"] = {slot: [n.node_id for n in ns] for slot, ns in nodes.items()}
        lane = Lane([n for n in LANE_B if not only or n in only], out, storage, cluster, nodes[SLOT_B], SLOT_B)
        lane.start()
        for name in [n for n in LANE_A if not only or n in only]:
            result[name] = run_scenario(name, out, storage, cluster, nodes[SLOT_A], SLOT_A)
        lane.join()
        result.update(lane.results)
    finally:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
        ray.shutdown()
        cluster.shutdown()
        address_file.put_back(address)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
