"""Incremental saves against full saves and DCP, step after step, and the load of a chained checkpoint.
2 gloo ranks, an FSDP2 state (``nn.Linear`` layers ``fully_shard``-ed on the CPU; ``model.state_dict()``
and an ``exp_avg`` / ``exp_avg_sq`` DTensor per trained param, changed in place each step): ``dense``,
``frozen70`` (a frozen encoder, a trained decoder with its moments) and ``lora99`` (a frozen base and
adapters). Each step saved by ``full`` (``rayckpt.save``, own directory), ``incremental``
(``rayckpt.save(incremental=True)``) and ``dcp`` (``dcp.save``, own directory), the order rotated, after
one untimed save of each elsewhere; every file evicted from the page cache after each save. Seconds: the
save call, barrier before, max over ranks; MiB: the files the save created (incremental: its store files
and its directory). First: step 1; steady: median (min-max) of the later steps. Chained load: a chain of
incremental saves of ``frozen70`` against one self-contained save of its last state, ``rayckpt.load`` of
each alternating; cold: the files evicted first, warm: read in first."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from typing import Any

import torch.nn as nn

from benchmarks.common import cli, systems
from benchmarks.common.diskio import dir_bytes, evict, files_under, warm_up
from benchmarks.common.harness import MIB, load_sampled, new_report, rotated, timed, write_report
from benchmarks.common.workload import layer_shapes
from benchmarks.incremental.report import SAVERS, markdown, merge, summarize_chain, summarize_state, targets
from rayckpt.testing.multiproc import run_ranks

STATES = ("dense", "frozen70", "lora99")
#: Fraction of the state's bytes that never changes, per state.
FROZEN = {"dense": 0.0, "frozen70": 0.70, "lora99": 0.99}
SHARED = ".rayckpt-shared"
#: The system (``systems.save``) of each saver.
SYSTEMS = {"full": "rayckpt", "incremental": "rayckpt_incremental", "dcp": "dcp"}


def layout(kind: str, size_mb: float) -> dict[str, Any]:
    """The layers of a state: frozen (rows, cols), trained (rows, cols), and the adapters' rank (lora99)."""
    frozen_mb = size_mb * FROZEN[kind]
    frozen = layer_shapes(frozen_mb * 3) if frozen_mb else []  # one fp32 copy, not three
    if kind != "lora99":
        return {"frozen": frozen, "trained": layer_shapes(size_mb - frozen_mb, 8 if kind == "dense" else 4), "r": 0}
    edges = sum(rows + cols for rows, cols in frozen)
    r = max(1, round((size_mb - frozen_mb) * MIB / (12 * edges)))
    return {"frozen": frozen, "trained": [], "r": r}


def build(world: int, rank: int, kind: str, size_mb: float) -> tuple[Any, dict[str, Any]]:
    """The FSDP2 model (frozen and trained layers) and its trained params' moments, filled at random."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    lay = layout(kind, size_mb)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        frozen = nn.ModuleList(nn.Linear(cols, rows) for rows, cols in lay["frozen"])
        if lay["r"]:
            r = lay["r"]
            adapters = [
                (nn.Linear(cols, r, bias=False), nn.Linear(r, rows, bias=False)) for rows, cols in lay["frozen"]
            ]
            trained = nn.ModuleList(nn.Sequential(a, b) for a, b in adapters)
        else:
            trained = nn.ModuleList(nn.Linear(cols, rows) for rows, cols in lay["trained"])
        model = nn.Sequential(OrderedDict(frozen=frozen, trained=trained))  # never run forward; FSDP2 wants one
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1_000_003 + rank)
    moments: dict[str, Any] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().normal_(generator=gen)
            if name.startswith("frozen."):
                p.requires_grad_(False)
                continue
            m = {"exp_avg": torch.empty_like(p.detach()), "exp_avg_sq": torch.empty_like(p.detach())}
            m["exp_avg"].to_local().normal_(generator=gen)
            m["exp_avg_sq"].to_local().uniform_(generator=gen)
            moments[name] = m
    return model, moments


def state_of(model: Any, moments: dict[str, Any], step: int) -> dict[str, Any]:
    """What every saver saves: the model's sharded state dict, the moments and the step."""
    return {"model": model.state_dict(), "optim": moments, "step": step}


def train_step(model: Any, moments: dict[str, Any]) -> None:
    """Change every trained param and moment in place (a small value added), as an optimizer step does."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in moments:
                p.to_local().add_(1e-3)
                moments[name]["exp_avg"].to_local().add_(1e-4)
                moments[name]["exp_avg_sq"].to_local().add_(1e-6)


def new_bytes(saver: str, path: str, save_id: str) -> dict[str, int]:
    """Bytes and files the save created: its directory, and for an incremental one its files in the store."""
    own, nfiles = dir_bytes(path)
    store = os.path.join(os.path.dirname(path), SHARED)
    names = os.listdir(store) if saver == "incremental" else []
    mine = [os.path.join(store, n) for n in names if n.startswith(save_id)]
    shards = sum(os.path.getsize(f) for f in mine)
    return {"bytes": own + shards, "store_bytes": shards, "dir_bytes": own, "files": nfiles + len(mine)}


def timed_save(saver: str, state: dict[str, Any], path: str, root: str) -> dict[str, Any]:
    """One save, barrier before; this rank's seconds, and on rank 0 the new bytes and rayckpt's phases."""
    import torch.distributed as dist

    dist.barrier()
    done = systems.save(SYSTEMS[saver], state, *systems.local(path))
    seconds, info = done["commit"], done["info"]
    dist.barrier()
    rec: dict[str, Any] = {"saver": saver, "seconds": seconds}
    if dist.get_rank() == 0:
        rec.update(new_bytes(saver, path, info.save_id if info else ""))
        if info is not None:
            rec |= {"phases": dict(info.phases), "reported_bytes_written": info.bytes_written}
        evict(files_under(root))
    dist.barrier()
    return rec


def saves_worker(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """``cfg["steps"]`` steps of one state, each saved by every saver (rotated); a record per save."""
    import torch.distributed.checkpoint  # noqa: F401 - imported before anything is timed

    from benchmarks.common.harness import import_rayckpt

    import_rayckpt()
    import torch.distributed as dist

    model, moments = build(world, rank, cfg["state"], cfg["size_mb"])
    root = cfg["root"]
    warm = os.path.join(root, "warm-up")
    for saver in SAVERS:  # untimed: what a process's first save pays once lands here, not in step 1
        timed_save(saver, state_of(model, moments, 0), os.path.join(warm, saver, "step-0"), root)
    if rank == 0:
        shutil.rmtree(warm)
    records = []
    for step in range(1, cfg["steps"] + 1):
        if step > 1:
            train_step(model, moments)
        state = state_of(model, moments, step)
        for saver in rotated(SAVERS, step - 1):
            path = os.path.join(root, saver, f"step-{step}")
            records.append({"step": step, **timed_save(saver, state, path, root)})
        if rank == 0:  # the self-contained ones are measured: remove them to bound the disk used
            for saver in ("full", "dcp"):
                shutil.rmtree(os.path.join(root, saver, f"step-{step}"))
        dist.barrier()
    return records


def timed_load(state: dict[str, Any], path: str, files: list[str], cold: bool) -> dict[str, Any]:
    """Zero the state, evict (cold) or read in (warm) ``files`` on rank 0, then one timed ``rayckpt.load``."""
    import torch.distributed as dist

    for t in systems.local_tensors(state):
        t.zero_()
    if dist.get_rank() == 0:
        (evict if cold else warm_up)(files)
    dist.barrier()
    seconds, info = timed(lambda: systems.load("rayckpt", state, *systems.local(path)))
    dist.barrier()
    return {"seconds": seconds, "phases": dict(getattr(info, "phases", None) or {})}


def same_bits(state: dict[str, Any], expected: list[Any]) -> int:
    """Tensors of the state (this rank's parts) that differ bit for bit from ``expected``, summed over ranks."""
    import torch
    import torch.distributed as dist

    got = systems.local_tensors(state)
    bad = sum(not torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, expected, strict=True))
    count = torch.tensor([bad + (len(got) != len(expected))])
    dist.all_reduce(count)
    return int(count.item())


def chain_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A chain of incremental saves of the frozen70 state and a self-contained one of its last state, then
    their loads alternating, cold and warm; this rank's seconds per load."""
    from benchmarks.common.harness import import_rayckpt

    import_rayckpt()
    model, moments = build(world, rank, "frozen70", cfg["size_mb"])
    root, n = cfg["root"], cfg["chain"]
    saves = []
    for step in range(1, n + 1):
        if step > 1:
            train_step(model, moments)
        path = os.path.join(root, "chain", f"step-{step}")
        saves.append({"step": step, **timed_save("incremental", state_of(model, moments, step), path, root)})
    state = state_of(model, moments, n)
    saves.append({"step": n, **timed_save("full", state, os.path.join(root, "self", f"step-{n}"), root)})
    expected = [t.clone() for t in systems.local_tensors(state)]
    chain, own = os.path.join(root, "chain"), os.path.join(root, "self", f"step-{n}")
    paths = {"chained": os.path.join(chain, f"step-{n}"), "self-contained": own}
    files = {"chained": files_under(chain), "self-contained": files_under(own)}
    timed_load(state, paths["self-contained"], files["self-contained"], True)  # untimed: the first load's costs
    loads: list[dict[str, Any]] = []
    checked: dict[str, int] = {}
    for rep in range(cfg["repeats"]):
        for cache in ("cold", "warm"):
            for kind in rotated(("chained", "self-contained"), rep):
                rec = timed_load(state, paths[kind], files[kind], cache == "cold")
                if kind not in checked:
                    checked[kind] = same_bits(state, expected)
                loads.append({"kind": kind, "cache": cache, "repeat": rep, **rec})
    return {"saves": saves, "loads": loads, "differing_tensors": checked}


def layout_bytes(kind: str, size_mb: float) -> dict[str, int]:
    """The state's bytes (params of every layer, moments of the trained ones) and its frozen bytes."""
    lay = layout(kind, size_mb)
    frozen = sum(4 * (rows * cols + rows) for rows, cols in lay["frozen"])
    trained = sum(12 * (rows * cols + rows) for rows, cols in lay["trained"])
    trained += sum(12 * lay["r"] * (rows + cols) for rows, cols in lay["frozen"] if lay["r"])
    return {"state_bytes": frozen + trained, "frozen_bytes": frozen}


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run each state's saves and the chained load on 2 ranks, write the report."""
    p = cli.parser(__doc__, "incremental")
    p.add_argument("--size-mb", type=float, default=1024, help="each state's size in MiB (default: %(default)s)")
    p.add_argument("--steps", type=int, default=12, help="saves per saver and state; the first is reported apart")
    p.add_argument("--repeats", type=int, default=5, help="loads of each checkpoint, cold and warm, in the chain test")
    p.add_argument("--chain", type=int, default=10, help="incremental saves in the chain that is loaded")
    p.add_argument("--states", type=cli.listed(STATES), default=",".join(STATES), help="any of " + ", ".join(STATES))
    p.add_argument("--no-chain", action="store_true", help="skip the chained load")
    args = cli.parse(p, argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first save and a steady one)")
    layouts = {s: layout_bytes(s, args.size_mb) for s in dict.fromkeys([*args.states, "frozen70"])}
    config = {k: v for k, v in vars(args).items() if k != "out"}
    report = new_report("benchmarks.incremental", argv, __doc__, config=config, layouts=layouts, states={})
    raw: dict[str, Any] = {}
    with load_sampled(report):
        for state in args.states:
            cfg = {"state": state, "size_mb": args.size_mb, "steps": args.steps}
            raw[state] = merge(in_dir(args.out, f"bench-incremental-{state}-", saves_worker, cfg))
            report["states"][state] = summarize_state(raw[state])
            print(f"[incremental] {state}: {report['states'][state]['ratios']}", flush=True)
        if not args.no_chain:
            cfg = {"size_mb": args.size_mb, "chain": args.chain, "repeats": args.repeats}
            ranks = in_dir(args.out, "bench-incremental-chain-", chain_worker, cfg)
            raw["chain"] = {**ranks[0], **{k: merge([r[k] for r in ranks]) for k in ("loads", "saves")}}
            report["chain"] = summarize_chain(raw["chain"])
            print(f"[incremental] chained load: cold {report['chain']['cold']['ratio']:.3f}", flush=True)
    report["targets"] = targets(report)
    report["records"] = raw
    return write_report(args, "incremental", report, markdown(report))


def in_dir(out: str, prefix: str, worker: Any, cfg: dict[str, Any]) -> list[Any]:
    """``worker`` on 2 ranks with ``cfg["root"]`` a new directory under ``out``, removed after."""
    root = tempfile.mkdtemp(prefix=prefix, dir=out)
    try:
        return run_ranks(worker, 2, {**cfg, "root": root}, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
