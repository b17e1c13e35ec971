"""Recovery time under Ray Train, measured: where the time from a failure to the next step goes."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from benchmarks.common.harness import load_sampled, machine_info, write_report
from benchmarks.common.workload import layer_shapes
from benchmarks.recovery.report import markdown, summarize
from benchmarks.recovery.scenarios import FAST_HEALTH_CHECK, START_TIMEOUT_ENV, node_removal, worker_kill

#: Row labels of the scenarios in the tables.
LABELS = {
    "worker-kill": "worker SIGKILLed",
    "worker-kill-memory": "worker SIGKILLed, memory tier",
    "node-removal": "node removed (Ray's defaults)",
    "node-removal-memory": "node removed (Ray's defaults), memory tier",
    "node-removal-fast": "node removed (faster GCS health checks)",
    "node-removal-start-timeout": "node removed (shorter worker group start timeout)",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=1024, help="state size in MiB (params + AdamW moments)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench_out/recovery")
    parser.add_argument(
        "--scenarios",
        default="worker-kill,node-removal",
        help="worker-kill, node-removal, worker-kill-memory, node-removal-memory (a -memory scenario also saves "
        "to the nodes' memory every step between the storage saves)",
    )
    parser.add_argument("--fast-health-check", action="store_true", help="add node removal with faster health checks")
    parser.add_argument(
        "--start-timeout-s",
        type=float,
        default=None,
        help=f"add node removal with {START_TIMEOUT_ENV} set to this (Ray Train's default: 60)",
    )
    parser.add_argument("--workers", type=int, default=4, help="workers before the failure (even: 2 nodes)")
    parser.add_argument("--kill-rank", type=int, default=1, help="the rank killed (its node, for node removal)")
    parser.add_argument("--save-every", type=int, default=5, help="save every K steps")
    parser.add_argument("--kill-after-save", type=int, default=2, help="break the run after the N-th save committed")
    parser.add_argument(
        "--kill-when",
        choices=("reported", "committed"),
        default="reported",
        help="the save counts once Ray Train has it (reported) or once committed (before Ray Train may know)",
    )
    parser.add_argument("--steps-past", type=int, default=2, help="... and this many steps past it")
    parser.add_argument("--after-steps", type=int, default=3, help="steps the restarted run does past its restore")
    parser.add_argument("--slack-steps", type=int, default=40, help="first attempt's steps past the kill point")
    parser.add_argument("--step-sleep-s", type=float, default=0.5, help="per step, standing in for compute")
    parser.add_argument("--object-store-mb", type=int, default=512, help="each Ray node's object store")
    parser.add_argument("--shm-root", default="/dev/shm", help="where the nodes' RAYCKPT_SHM_DIRs are made")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to reach a repeat's kill point")
    parser.add_argument("--ray-logs", action="store_true", help="forward the workers' output to this terminal")
    parser.add_argument("--markdown", default=None, help="also write the section here")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints under --out")
    args = parser.parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.repeats < 1 or args.workers < 2 or args.workers % 2:
        parser.error("--repeats >= 1 and an even --workers >= 2")
    if not 0 <= args.kill_rank < args.workers:
        parser.error("--kill-rank must be a rank of the first group")
    return args


def method(args: argparse.Namespace, scenarios: list[str]) -> list[str]:
    save_step = args.save_every * args.kill_after_save
    rows = "Default rows: Ray's default health checks and timeouts (nothing set)"
    if "node-removal-fast" in scenarios:
        rows += f"; 'faster GCS health checks': the head's `_system_config={FAST_HEALTH_CHECK}`"
    if "node-removal-start-timeout" in scenarios:
        rows += (
            f"; 'shorter worker group start timeout': `{START_TIMEOUT_ENV}={args.start_timeout_s:g}` (Ray Train's "
            "default 60 s: how long the controller waits for a group's workers before it gives up and decides again)"
        )
    return [
        "Each repeat is a fresh TorchTrainer run (gloo, CPU workers, `FailureConfig(max_failures=1)`, "
        f"`RayckptCallback`). The driver breaks it once step {save_step}'s save has "
        + (
            "committed and Ray Train has it (the controller's `after_report`)"
            if args.kill_when == "reported"
            else "committed (the MetadataActor's event; Ray Train may not have it yet)"
        )
        + f" and {args.steps_past} more steps are done.",
        f"worker kill: a local Ray (`ray.init(address='local')`), {args.workers} workers, rank {args.kill_rank}'s "
        "process SIGKILLed (`os.kill`).",
        f"node removal: a fresh `ray.cluster_utils.Cluster` per repeat, a head without training resources (the "
        "controller, the MetadataActor) and two worker nodes of "
        f"{args.workers // 2} CPUs (each its own `RAYCKPT_SHM_DIR`), storage a local directory shared by the "
        f"nodes, `ScalingConfig(num_workers=({args.workers // 2}, {args.workers}))`; the node of rank "
        f"{args.kill_rank} is removed with `Cluster.remove_node(node, allow_graceful=False)` (its raylet and "
        f"every process on it SIGKILLed, as when a machine dies). {rows}.",
        "Milestones: kill = just before `os.kill` / `remove_node`; noticed = the controller's "
        "`UserCallback.after_exception` (before `RayckptCallback` rolls back in-flight saves); workers restarted "
        "= the last worker of the new group entered the train loop; state built = the last began "
        "`Checkpointer.restore` (FSDP2 model and AdamW state made, Checkpointer created); restored = the last "
        "returned from `restore` (load N -> M + its staging buffer); first step = the last finished its first "
        "step. Events are `time.time()` lines appended to one file by every process (one machine, one clock).",
        "Controller milestones: the first state change to RESTARTING, SCHEDULING and RUNNING after the kill and "
        "the old group's shutdown / the new group's start (`ControllerCallback` / `WorkerGroupCallback` hooks).",
        "Steps re-done: the last step any worker finished before the kill, minus the restored step.",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray

    os.makedirs(os.path.join(args.out, "events"), exist_ok=True)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    known = ("worker-kill", "node-removal", "worker-kill-memory", "node-removal-memory")
    unknown = set(scenarios) - set(known)
    if unknown:
        raise SystemExit(f"unknown scenario(s) {sorted(unknown)}: {', '.join(known)}")
    if args.fast_health_check and "node-removal" in scenarios:
        scenarios.append("node-removal-fast")
    if args.start_timeout_s and "node-removal" in scenarios:
        scenarios.append("node-removal-start-timeout")
    shapes = layer_shapes(args.size_mb)
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "-m", "benchmarks.recovery", "restart", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "machine": {**machine_info(), "ray": ray.__version__},
        "state_bytes": 12 * sum(rows * cols + rows for rows, cols in shapes),
        "layer_shapes_rows_cols": shapes,
        "scenarios": {},
        "method": method(args, scenarios),
    }
    with load_sampled(report):
        for sc in scenarios:
            if sc.startswith("worker-kill"):
                repeats = worker_kill(args, sc)
            elif sc == "node-removal-start-timeout":
                os.environ[START_TIMEOUT_ENV] = str(args.start_timeout_s)
                try:
                    repeats = node_removal(args, sc, {})
                finally:
                    del os.environ[START_TIMEOUT_ENV]
            else:
                repeats = node_removal(args, sc, FAST_HEALTH_CHECK if sc.endswith("-fast") else {})
            report["scenarios"][sc] = {"label": LABELS[sc], "repeats": repeats, "summary": summarize(repeats)}
    md = markdown(report)
    write_report(args.out, "recovery", report, md, args.markdown)
    print(md)
    print(f"[recovery] total {report['total_runtime_s']:.0f} s; wrote {args.out}/recovery.json, recovery.md")
    return 0
