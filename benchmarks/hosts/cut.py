"""An elastic job's host cut off: the time from the cut to the restored worker group, by Ray's health checks.
Three Ray hosts (one worker each, ``jobs/train.py --num-workers 2-3``, a tiny GPT, a memory checkpoint
every step, S3 every ``--checkpoint-every`` steps) and an S3 host; a new cluster per run. At step
``--cut-after-step`` host 2's link goes down (a partition; its processes keep running). Seconds from the
cut: the GCS counts the node dead (a driver on host 0 polling ``ray.nodes()``); the restarted group's
rank 0 logs its restart line (``restart 1: resumed from step S with 2 worker(s), from <tier>``), as the
line reaches the job's driver log. ``default``: Ray's health checks as shipped; ``tuned``:
``TUNED_HEALTH_CHECKS``; ``tuned-start``: also ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=10`` (Ray Train's
wait for the group of 3 it first asks for after the cut). Medians over the runs."""

from __future__ import annotations

import argparse
import os
import re
import select
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import cli
from benchmarks.common.harness import document, load_sampled, new_report, rotated, table, write_report
from benchmarks.hosts.common import HOST_ENV, ROOT, require_hosts
from testbed.host_jobs import TINY, HostJob
from testbed.ray_hosts import TUNED_HEALTH_CHECKS

#: ``tuned``: Ray's health checks as docs/recovery.md recommends; ``tuned-start``: also Ray Train's wait for a
#: worker group that cannot start (the group of 3 asked for on the cluster as it was before the cut) cut to 10 s.
SETTINGS = {
    "default": {},
    "tuned": TUNED_HEALTH_CHECKS,
    "tuned-start": {**TUNED_HEALTH_CHECKS, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"},
}
CUT_HOST = 2
STARTED = re.compile(r"on (\d+) rank\(s\)")
STEP = re.compile(r"\] step (\d+)/")
RESTART = re.compile(r"restart (\d+): (?:resumed from step (\d+)[^,]*|.*?) with (\d+) worker\(s\)(?:, from (\w+))?")

#: Run on host 0: print ``ready`` once joined, then ``dead <time.time()>`` once node ``argv[2]`` is not alive.
_WATCH_SNIPPET = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print("ready", flush=True)
while sys.argv[2] in {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}:
    time.sleep(0.1)
print("dead", time.time(), flush=True)
"""


def flags(cluster: Any, args: argparse.Namespace) -> list[str]:
    """``jobs/train.py``'s flags: an elastic 2-3 workers, one per host, a memory checkpoint every step."""
    assert cluster.s3 is not None
    out = ["--num-workers", "2-3", "--cpus-per-worker", str(cluster.num_cpus), "--memory-every", "1"]
    out += ["--checkpoint-every", str(args.checkpoint_every), "--steps", "1000000", "--max-failures", "3"]
    return [*out, "--run-name", "cut", "--storage-path", cluster.s3.uri("runs"), *TINY]


def one_cut(args: argparse.Namespace, setting: str, rep: int) -> dict[str, Any]:
    """One cluster with ``setting``'s environment, one job, host 2 cut: the times from the cut."""
    from testbed.ray_hosts import build_ray_hosts

    env = {**HOST_ENV, **SETTINGS[setting]}
    log_path = os.path.join(args.out, "cut-logs", f"{setting}-{rep}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    if os.path.exists(log_path):
        os.remove(log_path)
    cluster = build_ray_hosts(3, shm_mb=512, num_cpus=args.num_cpus, s3_bucket="hostbench", env=env, dashboard=True)
    job = None
    try:
        job = HostJob(cluster, flags(cluster, args), cwd=str(ROOT))
        _, line = job.wait_for(STARTED.search, args.timeout)
        started = STARTED.search(line)
        if started.group(1) != "3":
            raise RuntimeError(f"the job started with {started.group(1)} workers, not 3: {started.group(0)}")
        watch = [sys.executable, "-c", _WATCH_SNIPPET, cluster.address, cluster[CUT_HOST].ip]
        pipes = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL}
        watcher = cluster[0].popen(watch, text=True, **pipes)
        joined, _, _ = select.select([watcher.stdout], [], [], args.timeout)
        if not joined or not watcher.stdout.readline().startswith("ready"):  # it exits where it cannot join
            raise RuntimeError("the node watcher did not join the cluster")
        _, line = job.wait_for(lambda line: (m := STEP.search(line)) and int(m.group(1)) >= args.cut_after_step)
        last_step = int(STEP.search(line).group(1))
        cut_at = time.time()
        cluster[CUT_HOST].link_down()
        restored_at, line = job.wait_for(RESTART.search, args.timeout)
        restart = RESTART.search(line)
        dead = watcher.communicate(timeout=args.timeout)[0]  # it prints "dead <time>" and exits
        run = {"setting": setting, "repeat": rep, "step_at_cut": last_step, "restart_line": restart.group(0)}
        run |= {"restored_step": int(restart.group(2)) if restart.group(2) else None, "tier": restart.group(4)}
        run |= {"workers_after": int(restart.group(3)), "node_dead_s": float(dead.split()[-1]) - cut_at}
        return run | {"restored_s": restored_at - cut_at}
    finally:
        try:
            if job is not None:
                job.close()
                if os.path.exists(job.log_path):
                    shutil.copyfile(job.log_path, log_path)
        finally:
            cluster.close()


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting: the median of each time from the cut, and the tiers restored from."""
    out: dict[str, Any] = {}
    for setting in SETTINGS:
        mine = [r for r in runs if r["setting"] == setting and "error" not in r]
        if not mine:
            continue
        out[setting] = {key: statistics.median(r[key] for r in mine) for key in ("node_dead_s", "restored_s")}
        out[setting]["dead_to_restored_s"] = statistics.median(r["restored_s"] - r["node_dead_s"] for r in mine)
        out[setting]["tiers"] = sorted({str(r["tier"]) for r in mine})
        out[setting]["runs"] = len(mine)
    return out


def markdown(report: dict[str, Any]) -> str:
    rows = [
        {"setting": k, "runs": s["runs"], "cut -> node dead s": s["node_dead_s"], "cut -> restored s": s["restored_s"]}
        | {"node dead -> restored s": s["dead_to_restored_s"], "restored from": ", ".join(s["tiers"])}
        for k, s in report["summary"].items()
    ]
    runs = [
        {"run": f"{r['setting']} {r['repeat']}", "failed": r.get("error", "")[:200] or None}
        | {k: r.get(k) for k in ("step_at_cut", "restored_step", "workers_after", "node_dead_s", "restored_s", "tier")}
        for r in report["runs"]
    ]
    title = "A host cut off from an elastic job: the time to the restored group"
    return document(title, report, table(rows), table(runs))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = cli.parser(__doc__, "hosts", markdown=True)
    p.add_argument("--repeats", type=int, default=3, help="runs of each setting")
    p.add_argument("--settings", type=cli.listed(SETTINGS), default=",".join(SETTINGS), help=", ".join(SETTINGS))
    p.add_argument("--cut-after-step", type=int, default=30, help="cut once the group of 3 has logged this step")
    p.add_argument("--checkpoint-every", type=int, default=10, help="the job's storage (S3) saves")
    p.add_argument("--num-cpus", type=int, default=2, help="each Ray host's CPUs (one worker takes them all)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take to each of its moments")
    args = cli.parse(p, argv)
    if args.repeats < 1:
        p.error("--repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    require_hosts()
    config = {k: getattr(args, k) for k in ("repeats", "cut_after_step", "checkpoint_every", "num_cpus")}
    config["settings"] = {s: SETTINGS[s] for s in args.settings}
    report = new_report("benchmarks.hosts cut", argv, __doc__, config=config, runs=[])
    with load_sampled(report):
        for rep in range(args.repeats):
            for setting in rotated(args.settings, rep):
                try:
                    run = one_cut(args, setting, rep)
                except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
                    run = {"setting": setting, "repeat": rep, "error": f"{type(exc).__name__}: {exc}"}
                print(f"[hosts cut] {run}", flush=True)
                report["runs"].append(run)
    report["summary"] = summarize(report["runs"])
    write_report(args, "cut", report, markdown(report))
    return 0 if all("error" not in r for r in report["runs"]) else 1
