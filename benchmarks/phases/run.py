"""The first call as a user meets it: N ranks save, M ranks load, rayckpt beside DCP, with rayckpt's phases.
``get_state_dict`` of FSDP2 ``nn.Linear`` layers with AdamW, DCP and rayckpt alternating; ``fresh``: each
operation in newly spawned processes that imported ``torch.distributed.checkpoint`` and ``rayckpt``
first; ``steady``: repeated in the same processes. Seconds: median over the rounds, barrier to barrier,
max over ranks; rayckpt's phases: rank 0's ``SaveInfo.phases`` / ``LoadInfo.phases``."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from typing import Any

from benchmarks.common import cli, systems
from benchmarks.common.diskio import evict, files_under
from benchmarks.common.harness import document, load_sampled, new_report, table, timed, write_report
from benchmarks.common.workload import StackShape, build
from rayckpt.testing.multiproc import run_ranks

SYSTEMS = ("dcp", "rayckpt")


def worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run ``cfg["what"]`` of ``cfg["system"]`` ``cfg["times"]`` times here: [(seconds, phases)]."""
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - both systems' packages are imported before any timing
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import rayckpt  # noqa: F401

    shape = StackShape(cfg["width"], cfg["layers"])
    model, optim, _ = build(shape, "cpu", world, seed=1 if cfg["what"] == "save" else 2)
    where, rel = systems.local(cfg["path"])

    def op(state: dict[str, Any]) -> Any:
        if cfg["what"] == "save":
            return systems.save(cfg["system"], state, where, rel)["info"]
        return systems.load(cfg["system"], state, where, rel)

    out = []
    for _ in range(cfg["times"]):
        if cfg["what"] == "save" and rank == 0:
            shutil.rmtree(cfg["path"], ignore_errors=True)
        if cfg.get("cold") and rank == 0:
            evict(files_under(cfg["path"]))
        dist.barrier()
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        seconds, info = timed(lambda state=state: op(state), barrier=True)
        if cfg["what"] == "load":
            set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out.append((seconds, dict(getattr(info, "phases", None) or {})))
    return {"rank": rank, "runs": out}


def run(system: str, what: str, world: int, cfg: dict[str, Any], times: int, cold: bool = False) -> list[dict]:
    """``times`` operations in one set of fresh rank processes: per operation, its time (max over ranks) and
    rank 0's phases (it plans, reads the manifest and commits)."""
    job = {**cfg, "system": system, "what": what, "times": times, "cold": cold}
    ranks = run_ranks(worker, world, job, timeout=900)
    return [{"seconds": max(r["runs"][i][0] for r in ranks), "phases": ranks[0]["runs"][i][1]} for i in range(times)]


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, "phases")
    p.add_argument("--layers", type=int, default=20, help="nn.Linear(width, width) layers (20 x 2048: 1.007 GB)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--save-ranks", type=int, default=4)
    p.add_argument("--load-ranks", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--views", type=cli.listed(("fresh", "steady")), default="fresh,steady", help="fresh, steady")
    p.add_argument("--cold", action="store_true", help="also loads after evicting the files from the page cache")
    args = cli.parse(p, argv)
    nbytes = args.layers * (args.width * args.width + args.width) * 4 * 3
    cfg = {"layers": args.layers, "width": args.width}
    loads = [("load", False)] + ([("cold load", True)] if args.cold else [])
    results: dict[str, list[dict]] = {}
    config = {k: v for k, v in vars(args).items() if k != "out"}
    report = new_report("benchmarks.phases", argv, __doc__, state_bytes=nbytes, config=config, results=results)
    root = tempfile.mkdtemp(prefix="bench-phases-", dir=args.out)
    try:
        with load_sampled(report):
            for rnd in range(args.rounds if "fresh" in args.views else 0):
                for system in SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]:
                    c = {**cfg, "path": os.path.join(root, system)}
                    results.setdefault(f"fresh save {system}", []).extend(run(system, "save", args.save_ranks, c, 1))
                    for name, cold in loads:
                        rows = run(system, "load", args.load_ranks, c, 1, cold)
                        results.setdefault(f"fresh {name} {system}", []).extend(rows)
                print(f"[phases] round {rnd + 1}/{args.rounds} fresh done", flush=True)
            for system in SYSTEMS if "steady" in args.views else ():
                c = {**cfg, "path": os.path.join(root, system)}
                results[f"steady save {system}"] = run(system, "save", args.save_ranks, c, args.rounds + 1)[1:]
                for name, cold in loads:
                    results[f"steady {name} {system}"] = run(system, "load", args.load_ranks, c, args.rounds + 1, cold)[
                        1:
                    ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return write_report(args, "phases", report, markdown(report))


def median(rows: list[dict], key: str | None = None) -> float:
    return statistics.median(r["seconds"] if key is None else r["phases"].get(key, 0.0) for r in rows)


def markdown(report: dict[str, Any]) -> str:
    res, rows, phase_rows = report["results"], [], []
    for name in dict.fromkeys(k.rsplit(" ", 1)[0] for k in res):
        d, r = res.get(f"{name} dcp"), res.get(f"{name} rayckpt")
        if d and r:
            view, operation = name.split(" ", 1)
            rows.append({"view": view, "operation": operation, "DCP s": median(d), "rayckpt s": median(r)})
            rows[-1]["rayckpt / DCP"] = median(r) / median(d)
            keys = sorted({k for row in r for k in row["phases"] if k != "total"}, key=lambda k: -median(r, k))
            shown = ", ".join(f"{k} {median(r, k):.3f}" for k in keys)
            phase_rows.append({"operation": name, "total": median(r, "total"), "phases, largest first": shown})
    note = "rayckpt's phases (rank 0's `SaveInfo.phases` / `LoadInfo.phases`, medians, seconds):"
    return document("The first call and steady state", report, table(rows), note, table(phase_rows))
