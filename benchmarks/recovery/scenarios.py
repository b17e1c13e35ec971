"""How the recovery benchmark breaks a TorchTrainer run and times its recovery: one repeat per call."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common.workload import layer_shapes
from benchmarks.recovery.loop import ControllerTimeline, NoticeCallback, append_event, train_loop
from benchmarks.recovery.report import read_events, recovery_times

#: The custom resource that keeps training workers on the worker nodes of the ``node-removal`` cluster.
SLOT = "recovery_slot"
#: Faster GCS node health checks for the ``node-removal-fast`` row (Ray's defaults otherwise).
FAST_HEALTH_CHECK = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 2,
}
#: Ray Train's limit on a worker group's start (default 60 s), read by the controller at ``fit()``.
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


def make_trainer(
    args: argparse.Namespace, run: str, events: str, num_workers: Any, resources: dict, shared: bool, memory_every: int
):
    """The run's TorchTrainer: ``num_workers`` (an int, or (min, max) for elastic) gloo workers, one restart allowed."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    save_step = args.save_every * args.kill_after_save
    config = {
        "events": events,
        "shapes": layer_shapes(args.size_mb),
        "save_every": args.save_every,
        "steps": save_step + args.steps_past + args.slack_steps,
        "after_steps": args.after_steps,
        "step_sleep_s": args.step_sleep_s,
        "local_is_shared": shared or None,
        "memory_every": memory_every,
    }
    return TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=False, resources_per_worker=resources),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name=run,
            storage_path=os.path.join(args.out, "storage"),
            callbacks=[NoticeCallback(events), ControllerTimeline(events)],
            failure_config=FailureConfig(max_failures=1),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )


def wait_for_kill_point(
    args: argparse.Namespace, run: str, events: str, fit_done: threading.Event
) -> list[dict[str, Any]]:
    """Block until the chosen save is ``--kill-when`` (reported: committed and Ray Train has it) and
    ``--steps-past`` more steps are done; the first attempt's ``enter`` events."""
    import ray

    from rayckpt.ray import get_metadata_actor

    save_step = args.save_every * args.kill_after_save
    deadline = time.monotonic() + args.timeout
    reported = False
    while time.monotonic() < deadline and not fit_done.is_set():
        if not reported:
            got = ray.get(get_metadata_actor().events.remote(run))
            reported = any(e["kind"] == args.kill_when and e.get("step") == save_step for e in got)
        if reported and os.path.exists(events):
            evs = read_events(events)
            done = max((e["step"] for e in evs if e["kind"] == "step"), default=0)
            if done >= save_step + args.steps_past:
                return [e for e in evs if e["kind"] == "enter" and e["attempt"] == 0]
        time.sleep(0.05)
    raise TimeoutError(
        f"run {run}: step {save_step} not {args.kill_when} or {args.steps_past} steps past it "
        + ("before the run ended (--slack-steps too few?)" if fit_done.is_set() else f"in {args.timeout:g} s")
    )


def wait_node_dead(node_id: str, events: str, timeout: float) -> None:
    """Poll the GCS until it marks the node dead; record when (``node_dead``)."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            append_event(events, "node_dead", node=node_id)
            return
        time.sleep(0.1)


def record_actor_events(run: str, events: str) -> None:
    """Append the MetadataActor's events of ``run`` (committed, failed, reported, exception) as ``actor_<kind>``."""
    import ray

    from rayckpt.ray import get_metadata_actor

    with open(events, "a") as f:
        for e in ray.get(get_metadata_actor().events.remote(run)):
            data = {k: v for k, v in e.items() if k not in ("time", "kind", "writer_nodes")}
            f.write(json.dumps({"t": e["time"], "kind": f"actor_{e['kind']}", **data}, default=str) + "\n")


def run_repeat(args: argparse.Namespace, scenario: str, rep: int, kill: Callable[[list, str], None], **how) -> dict:
    """One TorchTrainer run broken by ``kill(entries, events)`` at the kill point; its recovery's figures."""
    run = f"recovery-{scenario}-{rep}"
    events = os.path.join(args.out, "events", f"{run}.jsonl")
    if os.path.exists(events):
        os.unlink(events)
    # A run directory left by an earlier invocation would be resumed (Ray Train's snapshot, our checkpoints).
    shutil.rmtree(os.path.join(args.out, "storage", run), ignore_errors=True)
    failure: list[BaseException] = []
    fit_done = threading.Event()

    def killer() -> None:
        try:
            kill(wait_for_kill_point(args, run, events, fit_done), events)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the driver's thread below
            failure.append(exc)

    thread = threading.Thread(target=killer, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    sigint = signal.getsignal(signal.SIGINT)
    try:
        result = make_trainer(args, run, events, **how).fit()
    finally:
        signal.signal(signal.SIGINT, sigint)  # fit() leaves Ray Train's handler (three Ctrl-C to exit) behind
        fit_done.set()
        thread.join()
    record_actor_events(run, events)
    if failure:
        raise failure[0]
    if result.error is not None:
        raise RuntimeError(f"run {run} failed: {result.error}")
    times = recovery_times(read_events(events))
    if times["world_before"] != args.workers:
        raise RuntimeError(f"run {run} started with {times['world_before']} workers, not {args.workers}")
    times["events_file"] = os.path.relpath(events, args.out)
    times["run_s"] = time.perf_counter() - t0
    if not args.keep:
        shutil.rmtree(os.path.join(args.out, "storage", run), ignore_errors=True)
    p = times["phases_s"]
    print(
        f"[recovery] {scenario} #{rep}: {times['world_before']}->{times['world_after']} workers, restored step "
        f"{times['restored_step']}, kill -> first step {times['total_s']:.1f} s (detect {p['detect']:.1f}, restart "
        f"{p['restart']:.1f}, build {p['build']:.1f}, restore {p['restore']:.2f}, first step {p['first_step']:.2f}), "
        f"{times['steps_redone']} steps re-done; run {times['run_s']:.0f} s",
        flush=True,
    )
    return times


def start_metadata_actor() -> None:
    """Start the MetadataActor (on the head node, where ``get_metadata_actor`` places it) before the run,
    so its start-up is in no measured phase."""
    import ray

    from rayckpt.ray import get_metadata_actor

    ray.get(get_metadata_actor().ping.remote())


def memory_every(scenario: str) -> int:
    """A ``-memory`` scenario saves to the nodes' memory every step between the storage saves."""
    return 1 if scenario.endswith("-memory") else 0


def worker_kill(args: argparse.Namespace, scenario: str = "worker-kill") -> list[dict[str, Any]]:
    """Fixed ``--workers`` workers on a local Ray; one worker SIGKILLed per repeat."""
    import ray

    ray.init(
        address="local",
        num_cpus=args.workers,
        object_store_memory=args.object_store_mb * 2**20,
        include_dashboard=False,
        log_to_driver=args.ray_logs,
        logging_level=logging.WARNING,
    )
    start_metadata_actor()

    def kill(entries: list[dict[str, Any]], events: str) -> None:
        (victim,) = [e for e in entries if e["rank"] == args.kill_rank]
        append_event(events, "kill", how="SIGKILL worker", rank=args.kill_rank, pid=victim["pid"])
        os.kill(victim["pid"], signal.SIGKILL)

    try:
        return [
            run_repeat(
                args,
                scenario,
                rep,
                kill,
                num_workers=args.workers,
                resources={"CPU": 1},
                shared=False,
                memory_every=memory_every(scenario),
            )
            for rep in range(args.repeats)
        ]
    finally:
        ray.shutdown()


def node_removal(args: argparse.Namespace, scenario: str, system_config: dict[str, Any]) -> list[dict[str, Any]]:
    """Each repeat on a fresh cluster of a head and two worker nodes, one of which is removed."""
    return [node_removal_repeat(args, scenario, rep, system_config) for rep in range(args.repeats)]


def node_removal_repeat(args: argparse.Namespace, scenario: str, rep: int, system_config: dict[str, Any]) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from rayckpt.ray.shm import SHM_DIR_ENV

    per_node = args.workers // 2
    store = args.object_store_mb * 2**20
    shm_root = os.path.join(args.shm_root, f"rayckpt-bench-recovery-{os.getpid()}-{scenario}-{rep}")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": store, "_system_config": system_config},
    )

    def kill(entries: list[dict[str, Any]], events: str) -> None:
        (victim,) = [e for e in entries if e["rank"] == args.kill_rank]
        node = next(n for n in cluster.worker_nodes if n.node_id == victim["node"])
        ranks = sorted(e["rank"] for e in entries if e["node"] == victim["node"])
        append_event(events, "kill", how="remove node", node=victim["node"], ranks=ranks)
        cluster.remove_node(node, allow_graceful=False)
        append_event(events, "node_removed")
        wait_node_dead(victim["node"], events, args.timeout)

    try:
        for i in range(2):
            shm = os.path.join(shm_root, f"node-{i}")
            os.makedirs(shm)
            cluster.add_node(
                num_cpus=per_node, resources={SLOT: per_node}, object_store_memory=store, env_vars={SHM_DIR_ENV: shm}
            )
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=args.ray_logs, logging_level=logging.WARNING)
        start_metadata_actor()
        return run_repeat(
            args,
            scenario,
            rep,
            kill,
            num_workers=(per_node, args.workers),
            resources={"CPU": 1, SLOT: 1},
            shared=True,
            memory_every=memory_every(scenario),
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(shm_root, ignore_errors=True)
