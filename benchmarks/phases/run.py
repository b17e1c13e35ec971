"""The first call as a user meets it: N ranks save, M ranks load, rayckpt beside DCP, with rayckpt's phases."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from benchmarks.common import systems
from benchmarks.common.cli import parser
from benchmarks.common.diskio import evict, files_under
from benchmarks.common.harness import load_sampled, new_report, table, timed, write_report
from rayckpt.testing.multiproc import run_ranks

SYSTEMS = ("dcp", "rayckpt")


def build(world: int, rank: int, layers: int, width: int, seed: int) -> tuple[Any, Any]:
    """The FSDP2 model and AdamW, its moments filled by one step."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def op(system: str, what: str, state: dict[str, Any], path: str) -> Any:
    where, rel = systems.local(path)
    if system == "rayckpt":
        return (systems.rayckpt_save if what == "save" else systems.rayckpt_load)(state, where, rel)
    return (systems.dcp_save if what == "save" else systems.dcp_load)(state, where, rel)


def worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run ``cfg["what"]`` of ``cfg["system"]`` ``cfg["times"]`` times here: [(seconds, phases)]."""
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - both systems' packages are imported before any timing
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import rayckpt  # noqa: F401

    model, optim = build(world, rank, cfg["layers"], cfg["width"], 1 if cfg["what"] == "save" else 2)
    out = []
    for _ in range(cfg["times"]):
        if cfg["what"] == "save" and rank == 0:
            shutil.rmtree(cfg["path"], ignore_errors=True)
        if cfg.get("cold") and rank == 0:
            evict(files_under(cfg["path"]))
        dist.barrier()
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        seconds, info = timed(lambda state=state: op(cfg["system"], cfg["what"], state, cfg["path"]), barrier=True)
        if cfg["what"] == "load":
            set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out.append((seconds, dict(getattr(info, "phases", None) or {})))
    return {"rank": rank, "runs": out}


def run(system: str, what: str, world: int, cfg: dict[str, Any], times: int, cold: bool = False) -> list[dict]:
    """``times`` operations in one set of fresh rank processes: per operation, its time (max over ranks) and
    rank 0's phases (it plans, reads the manifest and commits)."""
    job = {**cfg, "system": system, "what": what, "times": times, "cold": cold}
    ranks = run_ranks(worker, world, job, timeout=900)
    rows = []
    for i in range(times):
        rows.append({"seconds": max(r["runs"][i][0] for r in ranks), "phases": ranks[0]["runs"][i][1]})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "phases")
    p.add_argument("--layers", type=int, default=20, help="nn.Linear(width, width) layers (20 x 2048: 1.007 GB)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--save-ranks", type=int, default=4)
    p.add_argument("--load-ranks", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--views", default="fresh,steady", help="any of fresh, steady")
    p.add_argument("--cold", action="store_true", help="also loads after evicting the files from the page cache")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    nbytes = args.layers * (args.width * args.width + args.width) * 4 * 3
    root = tempfile.mkdtemp(prefix="bench-phases-", dir=args.out)
    cfg = {"layers": args.layers, "width": args.width}
    views = args.views.split(",")
    loads = [("load", False)] + ([("cold load", True)] if args.cold else [])
    results: dict[str, dict[str, list[dict]]] = {}
    began = time.time()
    report = new_report("benchmarks.phases", argv, state_bytes=nbytes, config=vars(args), results=results)
    try:
        with load_sampled(report):
            for rnd in range(args.rounds):
                order = SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]
                for system in order:
                    path = os.path.join(root, system)
                    c = {**cfg, "path": path}
                    if "fresh" in views:
                        results.setdefault(f"fresh save {system}", {}).setdefault("rows", []).extend(
                            run(system, "save", args.save_ranks, c, 1)
                        )
                        for name, cold in loads:
                            results.setdefault(f"fresh {name} {system}", {}).setdefault("rows", []).extend(
                                run(system, "load", args.load_ranks, c, 1, cold)
                            )
                print(f"[phases] round {rnd + 1}/{args.rounds} fresh done, {time.time() - began:.0f} s", flush=True)
            if "steady" in views:
                for system in SYSTEMS:
                    c = {**cfg, "path": os.path.join(root, system)}
                    results[f"steady save {system}"] = {
                        "rows": run(system, "save", args.save_ranks, c, args.rounds + 1)[1:]
                    }
                    for name, cold in loads:
                        rows = run(system, "load", args.load_ranks, c, args.rounds + 1, cold)[1:]
                        results[f"steady {name} {system}"] = {"rows": rows}
                print(f"[phases] steady done, {time.time() - began:.0f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["runtime_s"] = time.time() - began
    text = markdown(report)
    write_report(args.out, "phases", report, text)
    print(text)
    return 0


def median(rows: list[dict], key: str | None = None) -> float:
    return statistics.median(r["seconds"] if key is None else r["phases"].get(key, 0.0) for r in rows)


def markdown(report: dict[str, Any]) -> str:
    res, c = report["results"], report["config"]
    lines = [
        f"`{report['command']}` on {report['date']}, {report['runtime_s']:.0f} s; state "
        f"{report['state_bytes'] / 1e9:.3f} GB (`get_state_dict`), {c['save_ranks']} ranks save, "
        f"{c['load_ranks']} load; "
        f"seconds: median over {c['rounds']} rounds, barrier to barrier, max over ranks.",
        "",
    ]
    rows, phase_rows = [], []
    order = {"fresh": 0, "steady": 1}
    for name in sorted({k.rsplit(" ", 1)[0] for k in res}, key=lambda n: (order[n.split(" ")[0]], n)):
        view, operation = name.split(" ", 1)
        d, r = res.get(f"{name} dcp"), res.get(f"{name} rayckpt")
        if not d or not r:
            continue
        dm, rm = median(d["rows"]), median(r["rows"])
        rows.append([view, operation, f"{dm:.3f}", f"{rm:.3f}", f"{rm / dm:.2f}"])
        keys = sorted({k for row in r["rows"] for k in row["phases"]}, key=lambda k: -median(r["rows"], k))
        shown = ", ".join(f"{k} {median(r['rows'], k):.3f}" for k in keys if k != "total")
        phase_rows.append([f"{view} {operation}", f"{median(r['rows'], 'total'):.3f}", shown])
    lines += table(["view", "operation", "DCP s", "rayckpt s", "rayckpt / DCP"], rows, right=3)
    lines += ["", "rayckpt's phases (rank 0's `SaveInfo.phases` / `LoadInfo.phases`, medians, seconds):", ""]
    lines += table(["operation", "total", "phases, largest first"], phase_rows)
    return "\n".join(lines) + "\n"
