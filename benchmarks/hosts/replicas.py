"""A memory-tier replica from one host to another: over the writers' link against through Ray's object
store. Two Ray hosts (network and mount namespaces on a private bridge, each its own ``/dev/shm`` and
object store); a driver on host 0 copies a held file to host 1's ShardWriter by each way, rotated; a
copy's time: the call to its return (the replica held on host 1). Seconds: median (min-max) of the
repeats; MB/s: 1e6 bytes per second of the median."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from benchmarks.common import cli
from benchmarks.common.harness import MIB, document, load_sampled, new_report, rotated, summary, table, write_report
from benchmarks.hosts.common import HOST_ENV, ON_HOST, require_hosts, run_on_host

WAYS = ("link", "ray")
LABELS = {"link": "writer link (`link.send`)", "ray": "Ray's object store (`_replicate_through_ray`)"}


def copy_all(config: dict[str, Any]) -> dict[str, Any]:
    """The driver on host 0: every size, every repeat, each way; the seconds of each copy by way and size."""
    import logging
    import time

    import numpy as np
    import ray

    from rayckpt.ray import get_shard_writer
    from rayckpt.ray.actors import NAMESPACE
    from rayckpt.ray.memory import link
    from rayckpt.ray.memory.replication import _replicate_through_ray

    # joined quietly, in rayckpt's namespace (where the ShardWriters are)
    ray.init(address=config["address"], namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)
    peer = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == config["peer_ip"])
    writer = get_shard_writer(peer)
    endpoint = ray.get(writer.mem_endpoint.remote())
    copy = {
        "link": lambda path, fd, size: link.send(endpoint, path, fd, size),
        "ray": lambda path, fd, size: _replicate_through_ray(writer, path, fd, size),
    }
    seconds: dict[str, dict[str, list[float]]] = {way: {} for way in WAYS}
    rng = np.random.default_rng(0)
    for size_mb, warm_up in [(1, True), *((s, False) for s in config["sizes_mb"])]:
        size = int(size_mb * MIB)
        fd = held_file(rng, size)
        try:
            for rep in range(1 if warm_up else config["repeats"]):
                for way in rotated(WAYS, rep):
                    path = f"hostbench/{way}/{size}/{rep}"
                    t0 = time.perf_counter()
                    copy[way](path, fd, size)
                    took = time.perf_counter() - t0
                    if ray.get(writer.mem_delete.remote(path, False)) != 1:
                        raise RuntimeError(f"{path}: the replica was not held on host 1")
                    if not warm_up:
                        seconds[way].setdefault(str(size_mb), []).append(took)
        finally:
            os.close(fd)
    return {"seconds": seconds}


def held_file(rng: Any, size: int) -> int:
    """A file of ``size`` random bytes in ``/dev/shm``, unlinked, open read-write (as a ShardWriter holds one)."""
    name = f"/dev/shm/rayckpt-hostbench-{os.getpid()}"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(name)
    chunk = 16 * MIB
    for offset in range(0, size, chunk):
        os.pwrite(fd, rng.bytes(min(chunk, size - offset)), offset)
    return fd


def markdown(report: dict[str, Any]) -> str:
    rows = []
    for size, by_way in report["results"].items():
        for way, t in ((w, by_way[w]) for w in WAYS):
            rate = float(size) * MIB / 1e6 / t["median"]
            rows.append({"size MiB": float(size), "way": LABELS[way], "seconds": t, "MB/s": rate})
            rows[-1]["x link"] = t["median"] / by_way["link"]["median"]
    title = "A memory-tier replica between two hosts: the writer link against Ray's object store"
    return document(title, report, table(rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__doc__, "hosts", markdown=True)
    p.add_argument("--sizes-mb", type=cli.numbers, default="64,256", help="file sizes in MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="copies of each size each way")
    p.add_argument("--num-cpus", type=int, default=2, help="each Ray node's CPUs")
    p.add_argument("--timeout", type=float, default=1800, help="seconds the driver on host 0 may take")
    args = cli.parse(p, argv)
    if args.repeats < 1:
        p.error("--repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [ON_HOST]:
        print(json.dumps(copy_all(json.loads(argv[1]))))
        return 0
    args = parse_args(argv)
    require_hosts()
    from testbed.ray_hosts import build_ray_hosts

    biggest = int(max(args.sizes_mb))
    # Ray's copy holds the file in both nodes' object stores; the store's budget (half the tmpfs) holds the replica.
    object_store_mb = max(256, 2 * biggest)
    shm_mb = object_store_mb + 2 * biggest + 256
    config = {"repeats": args.repeats, "sizes_mb": args.sizes_mb, "hosts": 2, "num_cpus": args.num_cpus}
    config |= {"shm_mb": shm_mb, "object_store_mb": object_store_mb}
    report = new_report("benchmarks.hosts replicas", argv, __doc__, config=config)
    with load_sampled(report):
        cluster = build_ray_hosts(
            2, shm_mb=shm_mb, num_cpus=args.num_cpus, object_store_mb=object_store_mb, env=HOST_ENV
        )
        try:
            driver = {"address": cluster.address, "peer_ip": cluster[1].ip, "sizes_mb": args.sizes_mb}
            driver["repeats"] = args.repeats
            found = run_on_host(cluster[0], "benchmarks.hosts.replicas", driver, args.timeout)
        finally:
            cluster.close()
    report["results"] = {
        f"{size:g}": {way: summary(found["seconds"][way][str(size)], int(size * MIB)) for way in WAYS}
        for size in args.sizes_mb
    }
    return write_report(args, "replicas", report, markdown(report))


if __name__ == "__main__":
    sys.exit(main())
