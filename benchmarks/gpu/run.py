"""The GPU path in one process: the copy limit, DCP against rayckpt, first and later async saves, loads."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import systems
from benchmarks.common.cli import parser
from benchmarks.common.diskio import evict, files_under, warm_up
from benchmarks.common.harness import import_rayckpt, new_report, run_line, sync, timed, write_report
from benchmarks.common.systems import Where

#: The ``StagingOptions`` (pinned, shared, async staging, non-blocking copy) of each DCP stager measured.
DCP_STAGERS = {
    "default stager": None,
    "pinned": (True, False, False, False),
    "pinned + shared": (True, True, False, False),
    "pinned + async staging": (True, False, True, True),
    "all options (DefaultStager's defaults)": (True, True, True, True),
}


#: The orders ``save_async`` is measured in (``async_saves``).
ASYNC_ORDERS = ("unprepared", "prepared")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, "gpu")
    p.add_argument("--device", default="cuda", help="where the state lives: cuda (default) or cpu")
    p.add_argument("--size-gb", type=float, default=4.0, help="the state's size in GiB")
    p.add_argument("--tensors", type=int, default=32, help="how many fp32 tensors it is made of")
    p.add_argument("--repeats", type=int, default=2, help="repeats of each timed operation (medians)")
    p.add_argument("--saves", type=int, default=3, help="save_async saves in each order (the first, then later)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    return p.parse_args(argv)


def make_state(device: str, size_gb: float, tensors: int) -> dict[str, torch.Tensor]:
    numel = int(size_gb * 2**30 / 4 / tensors)
    g = torch.Generator().manual_seed(0)
    return {f"t{i:03d}": torch.randn(numel, generator=g).to(device) for i in range(tensors)}


def copy_limit(state: dict[str, torch.Tensor], device: str, repeats: int) -> dict[str, Any]:
    pinned = device.startswith("cuda")
    hosts = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in state.items()}

    def copy() -> None:
        for k, v in state.items():
            hosts[k].copy_(v, non_blocking=pinned)

    limit = [timed(copy, device=device)[0] for _ in range(repeats)]
    hosts.clear()
    pageable = [timed(lambda: [v.cpu() if pinned else v.clone() for v in state.values()], device=device)[0]]
    return {"limit_s": statistics.median(limit), "pageable_s": statistics.median(pageable), "pinned_host": pinned}


def check_equal(loaded: dict[str, torch.Tensor], state: dict[str, torch.Tensor], who: str) -> None:
    for k, v in state.items():
        if not torch.equal(loaded[k], v):
            raise AssertionError(f"{who}: tensor {k} differs from the saved state after the load")


def dcp_saves(state: dict[str, torch.Tensor], device: str, root: str, repeats: int) -> dict[str, Any]:
    where = Where(root)
    out: dict[str, Any] = {"save_s": [], "async": {}}
    for r in range(repeats):
        path = os.path.join(root, f"dcp-save-{r}")
        out["save_s"].append(timed(lambda r=r: systems.dcp_save(state, where, f"dcp-save-{r}"), device=device)[0])
        if r < repeats - 1:
            shutil.rmtree(path)
    out["kept"] = path
    for name, options in DCP_STAGERS.items():
        try:
            out["async"][name] = dcp_async(state, device, root, repeats, options)
        except Exception as exc:  # a configuration this torch cannot run is a result, not a crash
            out["async"][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    out["save_s"] = statistics.median(out["save_s"])
    return out


def dcp_async(state: dict[str, torch.Tensor], device: str, root: str, repeats: int, options: Any) -> dict[str, Any]:
    stager = systems.dcp_stager(options)
    stalls, totals = [], []
    try:
        for r in range(repeats):
            sync(device)
            start = time.perf_counter()
            pending = systems.dcp_async_save(state, Where(root), f"dcp-async-{r}", stager=stager)
            pending.staged()
            stalls.append(time.perf_counter() - start)
            pending.result()
            totals.append(time.perf_counter() - start)
            shutil.rmtree(os.path.join(root, f"dcp-async-{r}"))
    finally:
        if stager is not None:
            stager.close()
    return {
        "stall_s": stalls,
        "total_s": totals,
        "stall_median_s": statistics.median(stalls),
        "total_median_s": statistics.median(totals),
    }


def rayckpt_saves(state: dict[str, torch.Tensor], device: str, root: str, repeats: int) -> dict[str, Any]:
    times = []
    for r in range(repeats):
        path = os.path.join(root, f"rayckpt-save-{r}")
        times.append(timed(lambda r=r: systems.rayckpt_save(state, Where(root), f"rayckpt-save-{r}"), device=device)[0])
        if r < repeats - 1:
            shutil.rmtree(path)
    return {"save_s": statistics.median(times), "kept": path}


def async_saves(state: dict[str, torch.Tensor], device: str, root: str, saves: int, order: str) -> dict[str, Any]:
    """``saves`` save_async calls in a row in a new local Ray (new actors: the first save's fixed costs count)."""
    import ray

    from rayckpt.ray import get_shard_writer

    os.sync()  # the earlier writes' dirty pages go to disk now, not during this order's first commit
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    out: dict[str, Any] = {"saves": []}
    if order == "prepared":
        start = time.perf_counter()
        out["prepare_call_s"] = timed(lambda: systems.prepare_staging(state), device=device)[0]
        systems.staging_ready()
        ray.get(get_shard_writer().debug_stats.remote())
        out["prepare_background_s"] = time.perf_counter() - start
    for i in range(saves):
        path = os.path.join(root, f"async-{order}-{i}")
        sync(device)
        start = time.perf_counter()
        handle = systems.ray_save(state, Where(root), f"async-{order}-{i}", run="bench-gpu", step=i + 1)
        stall = time.perf_counter() - start
        entry = handle.wait()
        commit = time.perf_counter() - start
        if entry.status != "committed":
            raise RuntimeError(f"save_async of {path}: {entry.status}: {entry.error}")
        out["saves"].append({"stall_s": stall, "commit_s": commit, "staging": handle.staging})
        if i < saves - 1:
            shutil.rmtree(path)
    systems.release_staging()
    ray.shutdown()
    out["kept"] = path
    later = [s["stall_s"] for s in out["saves"][1:]]
    if later:
        out["first_over_later_stall"] = out["saves"][0]["stall_s"] / statistics.median(later)
    return out


def loads(state: dict[str, torch.Tensor], device: str, dcp_path: str, rk_path: str, repeats: int) -> dict[str, Any]:
    def dcp_load() -> dict[str, torch.Tensor]:
        t = {k: torch.zeros_like(v) for k, v in state.items()}
        systems.dcp_load(t, *systems.local(dcp_path))
        return t

    def rk_load() -> dict[str, torch.Tensor]:
        t = {k: torch.zeros_like(v) for k, v in state.items()}
        systems.rayckpt_load(t, *systems.local(rk_path))
        return t

    out: dict[str, Any] = {}
    for temp in ("cold", "warm"):
        for name, path, fn in (("dcp", dcp_path, dcp_load), ("rayckpt", rk_path, rk_load)):
            times = []
            for _ in range(repeats):
                files = files_under(path)
                evict(files) if temp == "cold" else warm_up(files)
                seconds, loaded = timed(fn, device=device)
                check_equal(loaded, state, f"{name} {temp} load")
                del loaded
                times.append(seconds)
            out[f"{name}_{temp}_s"] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (run with --device cpu for the CPU path)")
    import_rayckpt()  # imported before anything is timed
    started = time.perf_counter()
    root = args.dir or tempfile.mkdtemp(prefix="rayckpt-bench-gpu-")
    os.makedirs(root, exist_ok=True)
    state = make_state(args.device, args.size_gb, args.tensors)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    report = new_report("benchmarks.gpu", argv, args=vars(args), state_bytes=nbytes)
    report["machine"]["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    try:
        report["copy"] = copy_limit(state, args.device, args.repeats)
        report["dcp"] = dcp_saves(state, args.device, root, args.repeats)
        report["rayckpt"] = rayckpt_saves(state, args.device, root, args.repeats)
        report["save_async"] = {
            order: async_saves(state, args.device, root, args.saves, order) for order in ASYNC_ORDERS
        }
        report["loads"] = loads(state, args.device, report["dcp"]["kept"], report["rayckpt"]["kept"], args.repeats)
    finally:
        report["total_runtime_s"] = time.perf_counter() - started
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        if ray.is_initialized():
            ray.shutdown()
    md = "\n".join([run_line(report), "", "| measured | value |", "| --- | --- |", table(report)]) + "\n"
    write_report(args.out, "bench_gpu", report, md)
    print(md)
    return 0


def table(report: dict[str, Any]) -> str:
    """The report as the Markdown rows of its result table (docs/benchmarks.md, "GPUs")."""
    copy, dcp, loads_ = report["copy"], report["dcp"], report["loads"]
    rows = [
        ("limit: copy of the whole state into host memory allocated beforehand", f"{copy['limit_s']:.3f} s"),
        ("`.cpu()` / `.clone()` of each tensor", f"{copy['pageable_s']:.2f} s"),
        ("DCP `save`", f"{dcp['save_s']:.2f} s"),
    ]
    for name, res in dcp["async"].items():
        value = res["error"] if "error" in res else f"{res['stall_median_s']:.3f} s / {res['total_median_s']:.2f} s"
        rows.append((f"DCP `async_save`, {name}: stall / total", value))
    rows.append(("`rayckpt.save`", f"{report['rayckpt']['save_s']:.2f} s"))
    for order, res in report["save_async"].items():
        stalls = ", ".join(f"{s['stall_s']:.3f}" for s in res["saves"])
        commits = ", ".join(f"{s['commit_s']:.2f}" for s in res["saves"])
        ratio = res.get("first_over_later_stall")
        extra = f" (first / later: {ratio:.2f}x)" if ratio else ""
        if "prepare_background_s" in res:
            extra += f"; prepare_staging: {res['prepare_call_s']:.3f} s call, {res['prepare_background_s']:.2f} s made"
        rows.append((f"rayckpt `save_async`, {order}: stall per save", f"{stalls} s{extra}"))
        rows.append((f"rayckpt `save_async`, {order}: commit per save", f"{commits} s"))
    for temp in ("cold", "warm"):
        d, r = loads_[f"dcp_{temp}_s"], loads_[f"rayckpt_{temp}_s"]
        rows.append((f"load, {temp}: DCP / rayckpt", f"{d:.2f} s / {r:.2f} s ({d / r:.2f}x)"))
    return "\n".join(f"| {a} | {b} |" for a, b in rows)
