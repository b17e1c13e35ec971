"""rayckpt, and DCP's API on ``rayckpt.dcp``'s writer and reader, against DCP, torch.save and the raw disk on an FSDP2
state, on a local disk or an S3 endpoint through one code path. N gloo ranks save with every system, then M ranks
load each N->M reshard; each repeat runs every system once, the order rotated; times are barrier to barrier, the max
over ranks. Stall: the time the calling rank is blocked (``SaveHandle.stall_seconds``, the staging buffer made
beforehand with ``prepare_staging``; until ``dcp.async_save`` returns); commit: until the checkpoint is committed.
torch.save: the full state gathered to rank 0 once, then ``torch.save`` + fsync; raw disk: each rank writes its 1/N
of the bytes in 8 MiB blocks and fsyncs, then reads them back cold. Loads: the files evicted from the page cache
first ("warm": read in first); the first load of each system goes into a zeroed state and is checked bit-exact. Read
amplification: bytes read (rayckpt's ``LoadInfo``, DCP's ``rchar``; on S3 the server's GET bytes) / bytes needed.
Memory: /proc/self/status sampled in a thread. On S3: moto's server on this machine behind ``testbed.s3_counter``,
counting every request and its bytes; rayckpt on pyarrow's ``S3FileSystem``, DCP on s3fs (a fresh instance per
operation; loads also without read-ahead); the server shares the cores with the ranks, so counts, not times, are its
own."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any

from benchmarks.common import cli
from benchmarks.common.harness import REPO_ROOT, SAMPLE_INTERVAL_S, load_sampled, new_report, write_report
from benchmarks.common.systems import Where
from benchmarks.common.workload import STATE_BYTES_PER_PARAM, layer_shapes
from benchmarks.suite.ranks import LOADS, SAVES, load_report, load_worker, save_report, save_worker
from benchmarks.suite.report import markdown, targets
from rayckpt.testing.multiproc import run_ranks

BUCKET = "rayckpt-bench"


def run_size(args: argparse.Namespace, size_mb: float, where: Where, address: str, samples: dict) -> dict[str, Any]:
    """One state size: the saves, then every reshard's loads (sources first), then its targets."""
    label, n0, t0 = f"{size_mb:g}MB", args.save_ranks, time.perf_counter()
    rels = {s: f"{label}/n{n0}/{s}" for s in SAVES[args.storage]} | {"warmup": f"{label}/warmup"}
    where.delete(label)
    shapes = [(args.square[0],) * 2] * args.square[1] if args.square else layer_shapes(size_mb)
    cfg = {"where": where, "storage": args.storage, "rels": rels, "shapes": shapes}
    cfg |= {"repeats": args.repeats, "ray_address": address, "verify": not args.no_verify}
    cfg |= {"run": f"bench-{args.storage}-{label}", "mem_interval": args.mem_interval_ms / 1000}
    print(f"[suite] {label}: saving with {n0} ranks, {args.repeats} repeat(s)", flush=True)
    saved = run_ranks(save_worker, n0, cfg, timeout=args.timeout)
    total = saved[0]["state_bytes"]
    result: dict[str, Any] = {"size_mb": size_mb, "state_bytes": total, "save_ranks": n0, "on_disk": {}, "load": {}}
    result["save"] = save_report(saved, total)
    samples[label] = {"save": saved}
    for system in rels:
        files = where.files(rels[system])
        if files:
            result["on_disk"][system] = {"bytes": sum(os.path.getsize(f) for f in files), "files": len(files)}
    for system in ("rayckpt_ray", "dcp_async", "raw"):
        if system in rels:  # measured; not loaded
            where.delete(rels[system])

    reshards = [tuple(map(int, p.strip().replace("->", ":").split(":"))) for p in args.reshards.split(",")]  # 4:3,4->2
    ck = {n0: {s: rels[s] for s in ("rayckpt", "dcp", "dcp_rayckpt", "torch_save") if s in rels}}
    needed = {n for n, _ in reshards if n != n0}
    order = sorted(reshards, key=lambda nm: (nm[0] != n0, nm[1] not in needed))
    for i, (n, m) in enumerate(order):
        name = f"{n}->{m}"
        if n not in ck:
            raise SystemExit(f"reshard {name}: no {n}-rank checkpoint; N must be {n0} or the M of a reshard from {n0}")
        sources = {k: v for k, v in ck[n].items() if k != "torch_save" or m == 1}
        lcfg = {**cfg, "sources": sources, "checksums": saved[0]["checksums"]}
        if m in needed and m not in ck:
            ck[m] = lcfg["resave"] = {s: f"{label}/n{m}/{s}" for s in ("rayckpt", "dcp", "dcp_rayckpt")}
        loaded = run_ranks(load_worker, m, lcfg, timeout=args.timeout)
        result["load"][name], samples[label][name] = load_report(loaded, total), loaded
        print(f"[suite] {label}: load {name} done", flush=True)
        if where.endpoint is not None and all(later[0] != n for later in order[i + 1 :]):
            for rel in ck[n].values():
                where.delete(rel)  # the server holds objects in memory: free what no later load reads
    result["load"] = {f"{n}->{m}": result["load"][f"{n}->{m}"] for n, m in reshards}
    main_reshard = f"{n0}->3" if f"{n0}->3" in result["load"] else next(iter(result["load"]), "")
    result["targets"] = targets(result, main_reshard, args.storage)
    result["runtime_s"] = time.perf_counter() - t0
    if not args.keep:
        where.delete(label)
    return result


def run_plan_bench(spec: str, out: str, repeats: int) -> dict[str, Any]:
    """``benchmarks.micro plan`` at ``spec`` (SAVEDxTENSORSxTARGET) in its own process; its report."""
    saved, tensors, target = spec.lower().split("x")
    cmd = [sys.executable, "-m", "benchmarks.micro", "plan", "--saved-ranks", saved, "--tensors", tensors]
    subprocess.run([*cmd, "--target-ranks", target, "--repeats", str(repeats), "--out", out], check=True, cwd=REPO_ROOT)
    with open(os.path.join(out, "bench_plan.json")) as f:
        return json.load(f)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__doc__, "suite", markdown=True)
    p.add_argument("--storage", choices=("local", "s3"), default="local", help="a local directory or a local S3")
    p.add_argument("--sizes-mb", default="256,1024", help="state sizes in MiB (params + moments), comma-separated")
    p.add_argument("--square", type=lambda s: [int(x) for x in s.split("x")], help="WxN: N square Linear(W) layers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--save-ranks", type=int, default=4)
    p.add_argument("--reshards", default="4:3,4:2,2:4,4:1", help="N:M load reshards")
    p.add_argument("--mem-interval-ms", type=float, default=SAMPLE_INTERVAL_S * 1000, help="RSS sampling period")
    p.add_argument("--no-verify", action="store_true", help="skip the bit-exact check of the first loads")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints under --out (local)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per group of ranks")
    p.add_argument("--plan-scale", default="1024x2000x1000", help="planning, SAVEDxTENSORSxTARGET ('none': skip)")
    args = p.parse_args(argv)
    if args.storage == "s3" and args.out == p.get_default("out"):
        argv = [*argv, "--out", f"{cli.OUT}/s3"]
    args = cli.parse(p, argv)
    args.sizes_mb = [float(x) for x in args.sizes_mb.split(",") if x.strip()]
    if args.square:
        args.sizes_mb = [args.square[0] * (args.square[0] + 1) * args.square[1] * STATE_BYTES_PER_PARAM / 2**20]
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def s3_endpoint(stack: ExitStack, out: str) -> tuple[Any, dict[str, str]]:
    """moto's server behind the counting middleware, stopped when ``stack`` closes; its versions."""
    from importlib.metadata import version

    from rayckpt.testing.s3_server import S3_ENV, start_moto_server

    os.environ.update(S3_ENV)  # before ray.init: Ray's workers inherit the credentials
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    log = os.path.join(out, "moto.log")
    server = start_moto_server(log, BUCKET, module="testbed.s3_counter", env={"PYTHONPATH": path})
    stack.callback(server.stop)
    return server.endpoint, {n: version(n) for n in ("moto", "s3fs", "aiobotocore", "fsspec")}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import ray

    config = {k: getattr(args, k) for k in ("storage", "sizes_mb", "square", "repeats", "save_ranks", "reshards")}
    report = new_report("benchmarks.suite", argv, __doc__, config=config, sizes={})
    report["systems"] = {"save": SAVES[args.storage], "load": LOADS[args.storage]}
    samples: dict[str, Any] = {}
    with ExitStack() as stack, load_sampled(report):
        where = Where(args.out)
        if args.storage == "s3":
            endpoint, versions = s3_endpoint(stack, args.out)
            where = Where(args.out, endpoint)
            report["machine"].update(versions)
        # A cluster of its own (address="local"), even where someone else's was started with `ray start`.
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level=logging.WARN)
        stack.callback(ray.shutdown)
        address = ray.get_runtime_context().gcs_address
        for size_mb in args.sizes_mb:
            result = report["sizes"][f"{size_mb:g}MB"] = run_size(args, size_mb, where, address, samples)
            print(f"[suite] {size_mb:g}MB done in {result['runtime_s']:.0f}s", flush=True)
    if args.storage == "local" and args.plan_scale.lower() != "none":
        report["plan"] = run_plan_bench(args.plan_scale, args.out, args.repeats)
    report["samples"] = samples
    return write_report(args, "bench_suite" if args.storage == "local" else "bench_s3", report, markdown(report))
