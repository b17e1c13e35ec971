"""The object-storage benchmark: rayckpt against torch DCP's fsspec reader and writer on one S3 endpoint.

One run, one endpoint, both systems alternated within each repeat (the order
rotates from repeat to repeat). The endpoint is moto's S3 server as its own
process on 127.0.0.1 (``rayckpt.testing.s3_server``, as the S3 test tier starts
it), with moto's app wrapped in a counting middleware (``benchmarks.suite.s3_counter``):
every HTTP request of every rank is counted by the server (GETs, their body
bytes, PUTs and their body bytes), the same way for both systems. rayckpt goes
through pyarrow's ``S3FileSystem`` (``s3://`` URIs); DCP through
``FsspecWriter`` / ``FsspecReader`` on ``s3fs`` (aiobotocore), defaults otherwise.

For each state size (``workload``'s FSDP2 state: fp32 params + AdamW moments):

- save, ``--save-ranks`` (4) gloo ranks: ``rayckpt.save`` to ``s3://``, rayckpt's Ray
  ``save_async`` (stall = ``SaveHandle.stall_seconds``, commit = barrier to
  ``handle.wait()``) and ``dcp.save`` with ``FsspecWriter``;
- load, for each reshard N->M (default 4->3, 4->2, 2->4, 4->1): M fresh ranks load
  the rayckpt and DCP checkpoints of N ranks; the first load of each system goes
  into a zeroed state and is verified bit-exact against checksums of the saved
  state. 2-rank checkpoints are saved by the 4->2 ranks after their loads.
  Figures: time (max over ranks; median, min-max over repeats), GETs and bytes
  the server sent, bytes needed (the ranks' payload, rayckpt's ``LoadInfo``),
  read amplification = bytes sent / bytes needed; rayckpt's own ``LoadInfo``
  requests and bytes_fetched next to the server's counts.

Each checkpoint is deleted from the (in-memory) server once no later load needs it.

    .venv/bin/python -m benchmarks.suite --storage s3 --sizes-mb 256,1024 --repeats 3

Writes ``{out}/bench_s3.json`` (``--out``: ``bench_out/s3``), the markdown ``{out}/bench_s3.md`` and the
server's request log ``{out}/moto.log``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from benchmarks.common.cli import add_storage_arg
from benchmarks.common.harness import REPO_ROOT, load_average, load_avg_thread, machine_info
from benchmarks.common.workload import layer_shapes
from benchmarks.suite.load import parse_reshards
from benchmarks.suite.s3_ranks import s3_load_report, s3_load_worker, s3_save_report, s3_save_worker
from benchmarks.suite.s3_report import s3_markdown, s3_targets
from rayckpt.testing.multiproc import run_ranks
from rayckpt.testing.s3_server import S3_ENV, S3Endpoint, start_moto_server

BUCKET = "rayckpt-bench"


def run_size(args: argparse.Namespace, size_mb: float, endpoint: S3Endpoint, ray_address: str) -> dict[str, Any]:
    """One state size: the saves, then every reshard's loads; its figures and targets."""
    label = f"{size_mb:g}MB"
    n0 = args.save_ranks
    reshards = reshards_for(args, size_mb)
    shapes = layer_shapes(size_mb)
    rels = {s: f"{label}/n{n0}/{s}" for s in ("rayckpt", "rayckpt_ray", "dcp")}
    rels["warmup"] = f"{label}/warmup"
    endpoint.delete(label)
    t0 = time.perf_counter()
    cfg: dict[str, Any] = {
        "endpoint": endpoint,
        "rels": rels,
        "shapes": shapes,
        "repeats": args.repeats,
        "size_label": label,
        "ray_address": ray_address,
        "verify": not args.no_verify,
        "mem_interval": args.mem_interval_ms / 1000,
    }
    print(f"[s3] {label}: saving with {n0} ranks, {args.repeats} repeat(s)", flush=True)
    saved = run_ranks(s3_save_worker, n0, cfg, timeout=args.timeout)
    total = saved[0]["state_bytes"]
    result: dict[str, Any] = {
        "size_mb": size_mb,
        "state_bytes": total,
        "layer_shapes_rows_cols": shapes,
        "save_ranks": n0,
        "reshards": [f"{n}->{m}" for n, m in reshards],
        "save": s3_save_report(saved, total),
        "load": {},
    }
    print(f"[s3] {label}: saves done in {time.perf_counter() - t0:.0f}s", flush=True)
    run_loads(args, reshards, result, endpoint, saved[0]["checksums"])
    result["load"] = {f"{n}->{m}": result["load"][f"{n}->{m}"] for n, m in reshards}
    result["targets"] = s3_targets(result, f"{n0}->3")
    endpoint.delete(label)
    result["runtime_s"] = time.perf_counter() - t0
    return result


def run_loads(
    args: argparse.Namespace,
    reshards: list[tuple[int, int]],
    result: dict[str, Any],
    endpoint: S3Endpoint,
    sums: dict[str, Any],
) -> None:
    """Every N->M reshard's loads into ``result["load"]``; a checkpoint is deleted once no later load reads it."""
    n0 = args.save_ranks
    label = f"{result['size_mb']:g}MB"
    ck = {n0: {s: f"{label}/n{n0}/{s}" for s in ("rayckpt", "dcp")}}
    needed_sources = {n for n, _ in reshards if n != n0}
    order = sorted(reshards, key=lambda nm: (nm[0] != n0, nm[1] not in needed_sources))
    for i, (n, m) in enumerate(order):
        name = f"{n}->{m}"
        if n not in ck:
            raise SystemExit(f"reshard {name}: no {n}-rank checkpoint; N must be {n0} or the M of a reshard from {n0}")
        lcfg: dict[str, Any] = {
            "endpoint": endpoint,
            "shapes": result["layer_shapes_rows_cols"],
            "repeats": args.repeats,
            "sources": ck[n],
            "checksums": sums,
            "verify": not args.no_verify,
            "mem_interval": args.mem_interval_ms / 1000,
        }
        if m in needed_sources and m not in ck:
            ck[m] = {s: f"{label}/n{m}/{s}" for s in ("rayckpt", "dcp")}
            lcfg["resave"] = ck[m]
        t1 = time.perf_counter()
        loaded = run_ranks(s3_load_worker, m, lcfg, timeout=args.timeout)
        result["load"][name] = s3_load_report(loaded, result["state_bytes"])
        result["load"][name]["setup_s_per_rank"] = [round(r["setup_s"], 2) for r in loaded]
        print(f"[s3] {label}: load {name} done in {time.perf_counter() - t1:.0f}s", flush=True)
        if all(later[0] != n for later in order[i + 1 :]):
            for rel in ck[n].values():
                endpoint.delete(rel)  # the server holds objects in memory: free what no later load reads


def reshards_for(args: argparse.Namespace, size_mb: float) -> list[tuple[int, int]]:
    """``--reshards``, or this size's ``--reshards-at SIZE=N:M,...``."""
    for spec in args.reshards_at:
        size, _, text = spec.partition("=")
        if float(size) == size_mb:
            return parse_reshards(text)
    return parse_reshards(args.reshards)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="256,1024", help="state sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save-ranks", type=int, default=4)
    parser.add_argument("--reshards", default="4:3,4:2,2:4,4:1", help="N:M load reshards")
    parser.add_argument(
        "--reshards-at", action="append", default=[], help="SIZE=N:M,... : other reshards for one size (repeatable)"
    )
    add_storage_arg(parser, "s3")
    parser.add_argument("--out", default="bench_out/s3", help="directory for the report and the server's log")
    parser.add_argument("--mem-interval-ms", type=float, default=5.0, help="RSS sampling period; 0: off")
    parser.add_argument(
        "--moto-ranges",
        action="store_true",
        help="serve ranged GETs through moto's own path, which reads the whole object per GET",
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the bit-exact check of the first loads")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per group of ranks")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def storage_argv(argv: list[str]) -> list[str]:
    """``argv`` as ``python -m benchmarks.suite`` takes it: with ``--storage s3``."""
    return argv if "--storage" in argv or any(a.startswith("--storage=") for a in argv) else ["--storage", "s3", *argv]


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("moto", "s3fs", "aiobotocore", "fsspec", "werkzeug")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [float(x) for x in args.sizes_mb.split(",") if x.strip()]
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    os.environ.update(S3_ENV)  # before ray.init: Ray's workers inherit the credentials
    import ray

    samples: list[tuple[float, float, float | None]] = []
    before = os.getloadavg()
    stop = threading.Event()
    sampler = load_avg_thread(samples, stop)
    t0 = time.perf_counter()
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    server = start_moto_server(
        os.path.join(out, "moto.log"),
        BUCKET,
        module="benchmarks.suite.s3_counter",
        env={"PYTHONPATH": pythonpath},
        args=["--moto-ranges"] if args.moto_ranges else [],
    )
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "-m", "benchmarks.suite", *storage_argv(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "config": {
            "sizes_mb": sizes,
            "repeats": args.repeats,
            "save_ranks": args.save_ranks,
            "ranged_gets": "moto's own path" if args.moto_ranges else "in place (s3_counter.range_in_place)",
        },
        "machine": {**machine_info(), **versions(), "ray": ray.__version__},
        "endpoint": server.endpoint.host_port,
        "sizes": {},
    }
    try:
        # A cluster of its own (address="local"), even where someone else's was started with `ray start`.
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            _temp_dir=f"/tmp/rb3-{os.getpid()}",
        )
        address = ray.get_runtime_context().gcs_address
        for size_mb in sizes:
            result = run_size(args, size_mb, server.endpoint, address)
            report["sizes"][f"{size_mb:g}MB"] = result
            print(f"[s3] {size_mb:g}MB done in {result['runtime_s']:.0f}s", flush=True)
            with open(os.path.join(out, "bench_s3.partial.json"), "w") as f:
                json.dump(report, f, indent=1)
    finally:
        stop.set()
        sampler.join()
        ray.shutdown()
        server.stop()
    report["load_average_1min"] = load_average(before[0], samples)
    report["total_runtime_s"] = time.perf_counter() - t0
    md = s3_markdown(report)
    with open(os.path.join(out, "bench_s3.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, "bench_s3.md"), "w") as f:
        f.write(md)
    os.unlink(os.path.join(out, "bench_s3.partial.json"))
    print(md)
    print(f"[s3] total {report['total_runtime_s']:.0f}s; wrote {out}/bench_s3.json, {out}/bench_s3.md")
    return 0
