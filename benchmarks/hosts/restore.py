"""A restore on real hosts: a state held by three hosts' memory tier against the same state on the S3 host.
FSDP2 state (fp32 params + AdamW moments) saved by CPU workers (gloo) spread over three Ray hosts to
the hosts' memory tier (each share also held by the next host) and to S3 on a fourth host (moto); then
loaded into the same workers from each, barrier to barrier, rounds rotated (``memory_cost.restores``).
Seconds: median (min-max) over the rounds."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from benchmarks.common import cli
from benchmarks.common.harness import document, load_sampled, new_report, summary, table, write_report
from benchmarks.common.raytrain import read_events, trainer
from benchmarks.common.workload import layer_shapes
from benchmarks.hosts.common import HOST_ENV, ON_HOST, require_hosts, run_on_host

HOSTS = 3
#: The tiers loaded from, in the first round's order (``memory_cost.restores``' names).
SOURCES = ("memory", "s3")
LABELS = {"memory": "the hosts' memory tier", "s3": "S3 (the S3 host's moto server)"}


def restore_all(config: dict[str, Any]) -> dict[str, Any]:
    """The driver on host 0: one TorchTrainer run of ``memory_cost.cost_loop`` (its events go to a file)."""
    import logging

    import ray

    from benchmarks.recovery.memory_cost import cost_loop

    ray.init(address=config["address"], logging_level=logging.ERROR, log_to_driver=config["ray_logs"])
    loop = {"events": config["events"], "shapes": layer_shapes(config["size_mb"]), "s3_uri": config["s3_uri"]}
    loop |= {"rounds": 0, "steps": 0, "step_sleep_s": 0.0, "device": "cpu", "restore_from": list(SOURCES)}
    # the run's storage is a directory every host sees (the machine's own disk)
    loop |= {"shared": True, "restore_rounds": config["repeats"]}
    resources = {"CPU": config["cpus"]}
    trainer(cost_loop, loop, config["workers"], config["storage"], resources=resources).fit()
    return {}


def summarize(events: str) -> dict[str, Any]:
    """Per tier: the load's seconds in each round (the slowest rank's), and each rank's bytes read; the hosts
    the memory checkpoint's files were written on."""
    from benchmarks.recovery.memory_cost import restore_rounds

    lines = read_events(events)
    read: dict[str, dict[int, int]] = {}
    for e in (e for e in lines if e["kind"] == "restore"):
        read.setdefault(e["source"], {})[e["rank"]] = e["bytes_read"]
    writes = next((e["writes"] for e in lines if e["kind"] == "writes"), [])
    return {
        "load_s": restore_rounds(lines),
        "bytes_read_per_rank": {s: [by_rank[r] for r in sorted(by_rank)] for s, by_rank in read.items()},
        "memory_nodes_written": len({w["node"] for w in writes}),
        "memory_bytes_written": sum(w["bytes"] for w in writes),
    }


def markdown(report: dict[str, Any]) -> str:
    r, memory = report["results"], report["summary"]["memory"]["median"]
    written = f"{r['memory_nodes_written']} hosts wrote the memory tier's {r['memory_bytes_written'] / 1e9:.3f} GB."
    rows = [
        {"from": LABELS[k], "load s": s, "GB/s": s.get("GBps_median"), "x memory": s["median"] / memory}
        for k, s in ((k, report["summary"][k]) for k in SOURCES)
    ]
    return document("A restore across hosts: three hosts' memory tier against S3", report, written, table(rows))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = cli.parser(__doc__, "hosts", markdown=True, ray_logs=True)
    p.add_argument("--size-mb", type=float, default=1024, help="state size in MiB (params + AdamW moments)")
    p.add_argument("--workers", type=int, default=HOSTS, help="the ranks that save and load (M)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of loads from every tier")
    p.add_argument("--num-cpus", type=int, default=2, help="each Ray host's CPUs")
    p.add_argument(
        "--cpus-per-worker", type=float, default=None, help="default: the hosts' CPUs shared out over the workers"
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds the driver on host 0 may take")
    args = cli.parse(p, argv)
    if args.workers < 1 or args.repeats < 1 or args.size_mb <= 0:
        p.error("--workers >= 1, --repeats >= 1, --size-mb > 0")
    if args.cpus_per_worker is None:
        args.cpus_per_worker = HOSTS * args.num_cpus // args.workers or HOSTS * args.num_cpus / args.workers
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [ON_HOST]:
        print(json.dumps(restore_all(json.loads(argv[1]))))
        return 0
    args = parse_args(argv)
    require_hosts()
    from testbed.ray_hosts import build_ray_hosts

    events = os.path.join(args.out, "restore.jsonl")
    if os.path.exists(events):
        os.remove(events)
    shapes = layer_shapes(args.size_mb)
    object_store_mb = 256
    # Each host holds its share, a peer's share (the replica) and its workers' staging buffers in its /dev/shm.
    shm_mb = object_store_mb + int(2 * args.size_mb) + 256
    config = {k: getattr(args, k) for k in ("size_mb", "workers", "cpus_per_worker", "repeats", "num_cpus")}
    config |= {"hosts": HOSTS, "shm_mb": shm_mb, "object_store_mb": object_store_mb}
    report = new_report("benchmarks.hosts restore", argv, __doc__, config=config)
    report["state_bytes"] = 12 * sum(rows * cols + rows for rows, cols in shapes)
    storage = os.path.join(args.out, "restore-storage")
    with load_sampled(report):
        sizes = {"shm_mb": shm_mb, "num_cpus": args.num_cpus, "object_store_mb": object_store_mb}
        cluster = build_ray_hosts(HOSTS, **sizes, s3_bucket="hostbench", env=HOST_ENV)
        try:
            assert cluster.s3 is not None
            driver = {"address": cluster.address, "events": events, "storage": storage, "cpus": args.cpus_per_worker}
            driver |= {k: getattr(args, k) for k in ("size_mb", "workers", "repeats", "ray_logs")}
            driver["s3_uri"] = cluster.s3.uri(f"restore/{time.time_ns()}")
            run_on_host(cluster[0], "benchmarks.hosts.restore", driver, args.timeout)
        finally:
            cluster.close()
            shutil.rmtree(storage, ignore_errors=True)
    report["results"] = summarize(events)
    report["summary"] = {s: summary(report["results"]["load_s"][s], report["state_bytes"]) for s in SOURCES}
    report["summary"]["s3_over_memory"] = report["summary"]["s3"]["median"] / report["summary"]["memory"]["median"]
    return write_report(args, "restore", report, markdown(report))


if __name__ == "__main__":  # the driver on host 0 (``ON_HOST``)
    sys.exit(main())
