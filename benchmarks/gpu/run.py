"""The GPU path in one process: ``--tensors`` fp32 tensors on the device. The limit: a copy of the whole
state into page-locked host memory allocated beforehand; DCP's ``save`` and ``async_save`` with each
stager (stall: until its staging is done); ``rayckpt.save``; ``save_async`` saves in a row in a new local
Ray, first without and then with ``prepare_staging`` (the first save's stall against the later ones);
loads into the device, cold (evicted from the page cache) and warm, each checked bit-exact. Seconds:
medians of ``--repeats``."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import cli, systems
from benchmarks.common.diskio import evict, files_under, warm_up
from benchmarks.common.harness import document, import_rayckpt, new_report, sync, table, timed, write_report
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
    p = cli.parser(__doc__, "gpu")
    p.add_argument("--device", default="cuda", help="where the state lives: cuda (default) or cpu")
    p.add_argument("--size-gb", type=float, default=4.0, help="the state's size in GiB")
    p.add_argument("--tensors", type=int, default=32, help="how many fp32 tensors it is made of")
    p.add_argument("--repeats", type=int, default=2, help="repeats of each timed operation (medians)")
    p.add_argument("--saves", type=int, default=3, help="save_async saves in each order (the first, then later)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    return cli.parse(p, argv)


def make_state(device: str, size_gb: float, tensors: int) -> dict[str, torch.Tensor]:
    numel = int(size_gb * 2**30 / 4 / tensors)
    g = torch.Generator().manual_seed(0)
    return {f"t{i:03d}": torch.randn(numel, generator=g).to(device) for i in range(tensors)}


def copy_limit(state: dict[str, torch.Tensor], device: str, repeats: int) -> dict[str, Any]:
    pinned = device.startswith("cuda")
    copy = systems.BareCopy(state, pinned=pinned)
    limit = [timed(copy.save, device=device)[0] for _ in range(repeats)]
    del copy
    pageable = timed(lambda: [v.cpu() if pinned else v.clone() for v in state.values()], device=device)[0]
    return {"limit_s": statistics.median(limit), "pageable_s": pageable, "pinned_host": pinned}


def saves(system: str, state: Any, device: str, root: str, repeats: int, **options: Any) -> tuple[dict, str]:
    """``repeats`` saves by ``system`` into ``root``, each removed but the last: median stall and commit; the
    last one's path."""
    stalls, commits = [], []
    for r in range(repeats):
        sync(device)
        done = systems.save(system, state, Where(root), f"{system}-{r}", **options)
        sync(device)
        stalls.append(done["stall"])
        commits.append(done["commit"])
        if r < repeats - 1:
            shutil.rmtree(os.path.join(root, f"{system}-{r}"))
    kept = os.path.join(root, f"{system}-{repeats - 1}")
    return {"stall_s": stalls, "save_s": statistics.median(commits), "stall_median_s": statistics.median(stalls)}, kept


def dcp_saves(state: dict[str, torch.Tensor], device: str, root: str, repeats: int) -> dict[str, Any]:
    out, kept = saves("dcp", state, device, root, repeats)
    out |= {"kept": kept, "async": {}}
    for name, options in DCP_STAGERS.items():
        try:
            stager = systems.dcp_stager(options)
            try:
                out["async"][name], kept = saves("dcp_async", state, device, root, repeats, stager=stager)
            finally:
                if stager is not None:
                    stager.close()
            shutil.rmtree(kept)
        except Exception as exc:  # a configuration this torch cannot run is a result, not a crash
            out["async"][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    return out


def async_saves(state: dict[str, torch.Tensor], device: str, root: str, count: int, order: str) -> dict[str, Any]:
    """``count`` save_async calls in a row in a new local Ray (new actors: the first save's fixed costs count)."""
    import ray

    from rayckpt.ray import get_shard_writer
    from rayckpt.ray.rank import async_save

    os.sync()  # the earlier writes' dirty pages go to disk now, not during this order's first commit
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    out: dict[str, Any] = {"saves": []}
    if order == "prepared":
        start = time.perf_counter()
        out["prepare_call_s"] = timed(lambda: systems.prepare_staging(state), device=device)[0]
        async_save.saver().buffer.ready()  # the buffer made in the background
        ray.get(get_shard_writer().debug_stats.remote())
        out["prepare_background_s"] = time.perf_counter() - start
    for i in range(count):
        sync(device)
        done = systems.save("rayckpt_ray", state, Where(root), f"async-{order}-{i}", run="bench-gpu", step=i + 1)
        out["saves"].append({"stall_s": done["stall"], "commit_s": done["commit"], "staging": done["info"].staging})
        if i < count - 1:
            shutil.rmtree(os.path.join(root, f"async-{order}-{i}"))
    systems.release_staging()
    ray.shutdown()
    out["kept"] = os.path.join(root, f"async-{order}-{count - 1}")
    later = [s["stall_s"] for s in out["saves"][1:]]
    if later:
        out["first_over_later_stall"] = out["saves"][0]["stall_s"] / statistics.median(later)
    return out


def loads(state: dict[str, torch.Tensor], device: str, paths: dict[str, str], repeats: int) -> dict[str, Any]:
    """Cold and warm loads by each system of ``paths`` into zeroed tensors on the device, checked bit-exact."""

    def load(system: str) -> dict[str, torch.Tensor]:
        t = {k: torch.zeros_like(v) for k, v in state.items()}
        systems.load(system, t, *systems.local(paths[system]))
        return t

    out: dict[str, Any] = {}
    for temp in ("cold", "warm"):
        for system in paths:
            times = []
            for _ in range(repeats):
                files = files_under(paths[system])
                evict(files) if temp == "cold" else warm_up(files)
                seconds, loaded = timed(lambda system=system: load(system), device=device)
                if any(not torch.equal(loaded[k], v) for k, v in state.items()):
                    raise AssertionError(f"{system} {temp} load: a tensor differs from the saved state")
                del loaded
                times.append(seconds)
            out[f"{system}_{temp}_s"] = statistics.median(times)
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
    config = {k: v for k, v in vars(args).items() if k not in ("out", "dir")}
    report = new_report("benchmarks.gpu", argv, __doc__, config=config, state_bytes=nbytes)
    report["machine"]["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    try:
        report["copy"] = copy_limit(state, args.device, args.repeats)
        report["dcp"] = dcp_saves(state, args.device, root, args.repeats)
        report["rayckpt"], kept = saves("rayckpt", state, args.device, root, args.repeats)
        orders = {order: async_saves(state, args.device, root, args.saves, order) for order in ASYNC_ORDERS}
        report["save_async"] = orders
        report["loads"] = loads(state, args.device, {"dcp": report["dcp"]["kept"], "rayckpt": kept}, args.repeats)
    finally:
        report["total_runtime_s"] = time.perf_counter() - started
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        if ray.is_initialized():
            ray.shutdown()
    return write_report(args, "bench_gpu", report, document("The GPU path", report, table(rows(report))))


def rows(report: dict[str, Any]) -> list[dict[str, str]]:
    """The report as the rows of its result table (docs/benchmarks.md, "GPUs")."""
    copy, dcp, loads_ = report["copy"], report["dcp"], report["loads"]
    out = [
        ("limit: copy of the whole state into host memory allocated beforehand", f"{copy['limit_s']:.3f} s"),
        ("`.cpu()` / `.clone()` of each tensor", f"{copy['pageable_s']:.2f} s"),
        ("DCP `save`", f"{dcp['save_s']:.2f} s"),
    ]
    for name, res in dcp["async"].items():
        value = res["error"] if "error" in res else f"{res['stall_median_s']:.3f} s / {res['save_s']:.2f} s"
        out.append((f"DCP `async_save`, {name}: stall / total", value))
    out.append(("`rayckpt.save`", f"{report['rayckpt']['save_s']:.2f} s"))
    for order, res in report["save_async"].items():
        stalls = ", ".join(f"{s['stall_s']:.3f}" for s in res["saves"])
        commits = ", ".join(f"{s['commit_s']:.2f}" for s in res["saves"])
        ratio = res.get("first_over_later_stall")
        extra = f" (first / later: {ratio:.2f}x)" if ratio else ""
        if "prepare_background_s" in res:
            extra += f"; prepare_staging: {res['prepare_call_s']:.3f} s call, {res['prepare_background_s']:.2f} s made"
        out.append((f"rayckpt `save_async`, {order}: stall per save", f"{stalls} s{extra}"))
        out.append((f"rayckpt `save_async`, {order}: commit per save", f"{commits} s"))
    for temp in ("cold", "warm"):
        d, r = loads_[f"dcp_{temp}_s"], loads_[f"rayckpt_{temp}_s"]
        out.append((f"load, {temp}: DCP / rayckpt", f"{d:.2f} s / {r:.2f} s ({d / r:.2f}x)"))
    return [{"measured": a, "value": b} for a, b in out]
