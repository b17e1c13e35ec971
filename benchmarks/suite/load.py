"""The suite's load measurements: N->M reshard loads, their read amplification and memory.

``load_worker`` runs on each of the M gloo ranks of one reshard (spawned by
``run_ranks``, so it stays a module-level function): it builds a fresh,
differently seeded FSDP2 state and per repeat loads every checkpoint it is given
(rayckpt, DCP, on 4->1 also torch.load; the ``_warm`` systems load the same files
after rank 0 read them into the page cache), the order rotating from repeat to
repeat, with the page cache evicted before each load. The first load of each system
goes into a zeroed state and is checked bit-exact against the saved checksums.
It can then save M-rank checkpoints for a later M->K reshard. ``load_report``
reduces the ranks' records to the report's figures.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch

import rayckpt
from benchmarks.common.diskio import evict, files_under, resident_fraction, warm_up
from benchmarks.common.harness import import_rayckpt, measure, mem_summary, rotated, summary
from benchmarks.common.workload import build_state, local_bytes, verify_loaded, zero_state

LOAD_SYSTEMS = ("rayckpt", "dcp", "torch_load", "rayckpt_warm", "dcp_warm")
#: Loads with the checkpoint already in the page cache (a restart on the same node).
WARM_SYSTEMS = {"rayckpt_warm": "rayckpt", "dcp_warm": "dcp"}
LOAD_LABELS = {
    "rayckpt": "rayckpt load",
    "dcp": "torch DCP load",
    "torch_load": "torch.load + set_state_dict (1 proc)",
    "rayckpt_warm": "rayckpt load, page cache warm",
    "dcp_warm": "torch DCP load, page cache warm",
}


def parse_reshards(text: str) -> list[tuple[int, int]]:
    """``"4:3,4->2"`` -> [(4, 3), (4, 2)]."""
    out = []
    for part in text.split(","):
        n, _, m = part.strip().replace("->", ":").partition(":")
        out.append((int(n), int(m)))
    return out


# ---------------------------------------------------------------------------
# On the ranks


def load_worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One load rank: every repeat of every load system in ``cfg["sources"]``; its records for ``load_report``."""
    import_rayckpt()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    t_setup = time.perf_counter()
    model, optim, app = build_state(world_size, rank, seed=100, shapes=cfg["shapes"])
    state = {"app": app}
    sources = cfg["sources"]
    systems = [s for s in LOAD_SYSTEMS if s in sources]
    out: dict[str, Any] = {
        "rank": rank,
        "own_bytes": local_bytes(app),
        "load": {s: [] for s in systems},
        "verified": {},
        "setup_s": time.perf_counter() - t_setup,
    }
    me = {"rank": os.getpid()}
    all_files = [f for p in sources.values() for f in (files_under(p) if os.path.isdir(p) else [p])]
    ops = load_ops(model, optim, app, sources)
    for rep in range(cfg["repeats"]):
        for system in rotated(systems, rep):
            if rep == 0 and cfg["verify"]:
                zero_state(model, optim, app)
            resident = None
            if rank == 0:
                out["fadvise_used"] = evict(all_files)
                resident = prepare_cache(system, sources[system])
            rec = measure(ops[system], me, cfg["mem_interval"])
            rec["repeat"] = rep
            rec["resident_before"] = resident
            out["load"][system].append(rec)
            if rep == 0 and cfg["verify"]:
                out["verified"][system] = verify_loaded(system, model, optim, app, cfg["checksums"])

    resave = cfg.get("resave")
    if resave:  # the checkpoints of this world size, for later N->M loads from it
        if rank == 0:
            for p in resave.values():
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
        rayckpt.save(state, resave["rayckpt"])
        dcp.save(state, storage_writer=dcp.FileSystemWriter(resave["dcp"]))
    dist.barrier()
    return out


def load_ops(model: Any, optim: Any, app: Any, sources: dict[str, str]) -> dict[str, Callable[[float], dict]]:
    """The timed part of each load system (the ``_warm`` ones are their cold system's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = {"app": app}

    def op_rayckpt(t0: float) -> dict[str, Any]:
        info = rayckpt.load(state, sources["rayckpt"])
        return {"bytes_needed": info.bytes_needed, "bytes_read": info.bytes_read, "num_reads": info.num_reads}

    def op_dcp(t0: float) -> dict[str, Any]:
        dcp.load(state, storage_reader=dcp.FileSystemReader(sources["dcp"]))
        return {}

    def op_torch_load(t0: float) -> dict[str, Any]:
        sd = torch.load(sources["torch_load"], weights_only=True)
        read_s = time.perf_counter() - t0
        set_state_dict(
            model,
            optim,
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
            options=StateDictOptions(full_state_dict=True),
        )
        app.extras["step"] = sd["step"]
        del sd
        return {"read_s": read_s}

    ops = {"rayckpt": op_rayckpt, "dcp": op_dcp, "torch_load": op_torch_load}
    ops.update({warm: ops[cold] for warm, cold in WARM_SYSTEMS.items()})
    return ops


def prepare_cache(system: str, path: str) -> float | None:
    """Rank 0, after the eviction: read a warm system's files into the page cache; the resident fraction."""
    files = files_under(path) if os.path.isdir(path) else [path]
    if system in WARM_SYSTEMS:
        warm_up(files)
    return resident_fraction(files)


# ---------------------------------------------------------------------------
# On the driver


def load_report(loaded: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Per system: load time (max over ranks; median, min-max over repeats), read amplification, memory."""
    own = [r["own_bytes"] for r in loaded]
    out: dict[str, Any] = {"ranks": len(loaded), "own_bytes_per_rank": own}
    needed: list[int] | None = None
    if "rayckpt" in loaded[0]["load"]:
        needed = [r["load"]["rayckpt"][0]["bytes_needed"] for r in loaded]
    for system in loaded[0]["load"]:
        reps = len(loaded[0]["load"][system])
        rows = [[r["load"][system][i] for r in loaded] for i in range(reps)]
        walls = [max(x["wall"] for x in row) for row in rows]
        entry: dict[str, Any] = {
            "wall_s": summary(walls, total),
            "mem": mem_summary([r["load"][system] for r in loaded], "rank", own),
            "resident_before": [row[0].get("resident_before") for row in rows],
            "verified_tensors": loaded[0]["verified"].get(system),
            "disk_read_bytes": [sum(x["io"].get("read_bytes", 0) for x in row) for row in rows],
            "own_s_per_rank": [[round(x["own"], 4) for x in row] for row in rows],
        }
        rchar = [x["io"].get("rchar", 0) for x in rows[0]]
        if system in ("rayckpt", "rayckpt_warm"):
            read = [x["bytes_read"] for x in rows[0]]
            entry["bytes_read_per_rank"] = read
            entry["read_amplification"] = sum(read) / max(sum(needed or [1]), 1)
        else:
            entry["bytes_read_per_rank"] = rchar
            entry["read_amplification"] = sum(rchar) / max(sum(needed), 1) if needed else None
        entry["bytes_needed_per_rank"] = needed
        entry["read_syscall_bytes_per_rank"] = rchar
        if system == "torch_load":
            entry["torch_load_only_s"] = summary([max(x.get("read_s", 0.0) for x in row) for row in rows], total)
        out[system] = entry
    return out
