"""Recovery time under Ray Train: where the time from a failure to the next step goes.

Each repeat is a fresh TorchTrainer run (gloo CPU workers running ``recovery.loop.train_loop``,
``FailureConfig(max_failures=1)``, ``RayckptCallback``) on the suite's FSDP2 state, saved every
``--save-every`` steps; a step is an in-place update of every local shard, one all-reduce and a
sleep standing in for forward and backward. Once the chosen save is committed and reported to Ray
Train and ``--steps-past`` more steps are done, the driver breaks the run: ``worker-kill`` SIGKILLs a
rank's process on a local Ray; ``node-removal`` removes the rank's worker node of a fresh
``ray.cluster_utils.Cluster`` (a head without training resources and two worker nodes, each its own
``RAYCKPT_SHM_DIR``, ``ScalingConfig(num_workers=(W/2, W))``) with ``remove_node(allow_graceful=False)``;
Ray's default health checks and timeouts. A ``-memory`` scenario also saves to the nodes' memory every
step. Milestones, each when the last worker reaches it: kill; noticed (the controller's
``after_exception``); workers restarted (entered the loop); state built (began
``Checkpointer.restore``); restored; first step done. Events are ``time.time()`` lines appended to
one file by every process. Steps re-done:
the last step finished before the kill less the restored step. Seconds: median (min-max) over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import cli
from benchmarks.common.harness import load_sampled, new_report, write_report
from benchmarks.common.raytrain import append_event, new_ray, read_events, trainer
from benchmarks.common.workload import layer_shapes
from benchmarks.recovery.loop import NoticeCallback, train_loop
from benchmarks.recovery.report import markdown, recovery_times, summarize

#: Row labels of the scenarios in the tables.
LABELS = {
    "worker-kill": "worker SIGKILLed",
    "worker-kill-memory": "worker SIGKILLed, memory tier",
    "node-removal": "node removed (Ray's defaults)",
    "node-removal-memory": "node removed (Ray's defaults), memory tier",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__, "recovery", markdown=True, ray_logs=True)
    parser.add_argument("--size-mb", type=float, default=1024, help="state size in MiB (params + AdamW moments)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scenarios", type=cli.listed(LABELS), default="worker-kill,node-removal")
    parser.add_argument("--workers", type=int, default=4, help="workers before the failure (even: 2 nodes)")
    parser.add_argument("--kill-rank", type=int, default=1, help="the rank killed (its node, for node removal)")
    parser.add_argument("--save-every", type=int, default=5, help="save every K steps")
    parser.add_argument("--kill-after-save", type=int, default=2, help="break the run after the N-th save")
    parser.add_argument("--steps-past", type=int, default=2, help="... and this many steps past it")
    parser.add_argument("--after-steps", type=int, default=3, help="steps the restarted run does past its restore")
    parser.add_argument("--slack-steps", type=int, default=40, help="first attempt's steps past the kill point")
    parser.add_argument("--step-sleep-s", type=float, default=0.5, help="per step, standing in for compute")
    parser.add_argument("--object-store-mb", type=int, default=512, help="each Ray node's object store")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to reach a repeat's kill point")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints under --out")
    args = cli.parse(parser, argv)
    if args.repeats < 1 or args.workers < 2 or args.workers % 2:
        parser.error("--repeats >= 1 and an even --workers >= 2")
    if not 0 <= args.kill_rank < args.workers:
        parser.error("--kill-rank must be a rank of the first group")
    return args


def wait_for_kill_point(args: argparse.Namespace, run: str, events: str, fit_done: threading.Event) -> list[dict]:
    """Block until the chosen save is committed and reported to Ray Train and ``--steps-past`` more steps
    are done; the first attempt's ``enter`` events."""
    import ray

    from rayckpt.ray import get_metadata_actor

    save_step = args.save_every * args.kill_after_save
    deadline = time.monotonic() + args.timeout
    reported = False
    while time.monotonic() < deadline and not fit_done.is_set():
        if not reported:
            got = ray.get(get_metadata_actor().events.remote(run))
            reported = any(e["kind"] == "reported" and e.get("step") == save_step for e in got)
        if reported and os.path.exists(events):
            evs = read_events(events)
            done = max((e["step"] for e in evs if e["kind"] == "step"), default=0)
            if done >= save_step + args.steps_past:
                return [e for e in evs if e["kind"] == "enter" and e["attempt"] == 0]
        time.sleep(0.05)
    raise TimeoutError(
        f"run {run}: step {save_step} not reported or {args.steps_past} steps past it "
        + ("before the run ended (--slack-steps too few?)" if fit_done.is_set() else f"in {args.timeout:g} s")
    )


def record_actor_events(run: str, events: str) -> None:
    """Append the MetadataActor's events of ``run`` (committed, failed, reported, exception) as ``actor_<kind>``."""
    import ray

    from rayckpt.ray import get_metadata_actor

    with open(events, "a") as f:
        for e in ray.get(get_metadata_actor().events.remote(run)):
            data = {k: v for k, v in e.items() if k not in ("time", "kind", "writer_nodes")}
            f.write(json.dumps({"t": e["time"], "kind": f"actor_{e['kind']}", **data}, default=str) + "\n")


def run_repeat(
    args: argparse.Namespace, scenario: str, rep: int, kill: Callable[[list, str], None], resources: dict
) -> dict:
    """One TorchTrainer run broken by ``kill(entries, events)`` at the kill point; its recovery's figures."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig

    from rayckpt.ray import get_metadata_actor

    ray.get(get_metadata_actor().ping.remote())  # its start-up in no measured phase
    run = f"recovery-{scenario}-{rep}"
    events = os.path.join(args.out, "events", f"{run}.jsonl")
    if os.path.exists(events):
        os.unlink(events)
    # A run directory left by an earlier invocation would be resumed (Ray Train's snapshot, our checkpoints).
    shutil.rmtree(os.path.join(args.out, "storage", run), ignore_errors=True)
    node_removal = scenario.startswith("node-removal")
    config = {k: getattr(args, k) for k in ("save_every", "after_steps", "step_sleep_s")}
    config |= {"events": events, "shapes": layer_shapes(args.size_mb), "local_is_shared": node_removal or None}
    config["steps"] = args.save_every * args.kill_after_save + args.steps_past + args.slack_steps
    config["memory_every"] = 1 if scenario.endswith("-memory") else 0
    workers = (args.workers // 2, args.workers) if node_removal else args.workers
    run_config = {"name": run, "callbacks": [NoticeCallback(events)]}
    run_config |= {"failure_config": FailureConfig(max_failures=1)}
    run_config |= {"checkpoint_config": CheckpointConfig(num_to_keep=2)}
    job = trainer(train_loop, config, workers, os.path.join(args.out, "storage"), resources=resources, **run_config)
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
        result = job.fit()
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
    print(f"[recovery] {scenario} #{rep}: kill -> first step {times['total_s']:.1f} s, {times['phases_s']}", flush=True)
    return times


def worker_kill(args: argparse.Namespace, scenario: str) -> list[dict[str, Any]]:
    """Fixed ``--workers`` workers on a local Ray; one worker SIGKILLed per repeat."""

    def kill(entries: list[dict[str, Any]], events: str) -> None:
        (victim,) = [e for e in entries if e["rank"] == args.kill_rank]
        append_event(events, "kill", how="SIGKILL worker", rank=args.kill_rank, pid=victim["pid"])
        os.kill(victim["pid"], signal.SIGKILL)

    with new_ray(args.workers, object_store_mb=args.object_store_mb, logs=args.ray_logs) as (resources, _):
        return [run_repeat(args, scenario, rep, kill, resources) for rep in range(args.repeats)]


def node_removal(args: argparse.Namespace, scenario: str) -> list[dict[str, Any]]:
    """Each repeat on a fresh cluster of a head and two worker nodes, one of which is removed.

    A fresh cluster, not a node added back: Ray Train's elastic policy may not see a node added
    just before ``fit()`` and would start with fewer workers.
    """

    repeats = []
    for rep in range(args.repeats):
        cluster_ray = new_ray(args.workers, nodes=2, object_store_mb=args.object_store_mb, logs=args.ray_logs)
        with cluster_ray as (resources, cluster):

            def kill(entries: list[dict[str, Any]], events: str, cluster: Any = cluster) -> None:
                (victim,) = [e for e in entries if e["rank"] == args.kill_rank]
                node = next(n for n in cluster.worker_nodes if n.node_id == victim["node"])
                ranks = sorted(e["rank"] for e in entries if e["node"] == victim["node"])
                append_event(events, "kill", how="remove node", node=victim["node"], ranks=ranks)
                cluster.remove_node(node, allow_graceful=False)
                append_event(events, "node_removed")

            repeats.append(run_repeat(args, scenario, rep, kill, resources))
    return repeats


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(os.path.join(args.out, "events"), exist_ok=True)
    shapes = layer_shapes(args.size_mb)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "markdown", "ray_logs")}
    report = new_report("benchmarks.recovery restart", argv, __doc__, config=config, scenarios={})
    report["state_bytes"] = 12 * sum(rows * cols + rows for rows, cols in shapes)
    with load_sampled(report):
        for sc in args.scenarios:
            repeats = (worker_kill if sc.startswith("worker-kill") else node_removal)(args, sc)
            report["scenarios"][sc] = {"label": LABELS[sc], "repeats": repeats, "summary": summarize(repeats)}
    return write_report(args, "recovery", report, markdown(report))
