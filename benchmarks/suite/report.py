"""The suite's report: targets as data and the Markdown tables."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common.harness import MIB, document, mib, table, target, targets_table

#: "Bounded buffer" allowed on top of a rank's own shard in the memory target.
MEM_BUFFER_BYTES = 64 * 2**20
#: Planning target: all target ranks' plans in under this many seconds.
PLAN_TARGET_S = 1.0
#: rayckpt's bytes fetched per byte needed on an S3 reshard load, at most.
READ_AMP_TARGET = 1.05

LABELS = {
    "rayckpt": "rayckpt (in process)",
    "rayckpt_ray": "rayckpt Ray save_async",
    "dcp": "torch DCP",
    "dcp_async": "torch DCP async_save",
    "dcp_rayckpt": "torch DCP API, rayckpt.dcp writer/reader",
    "torch_save": "torch.save (rank 0, full state)",
    "raw": "raw disk (write + fsync)",
    "torch_load": "torch.load + set_state_dict (1 proc)",
    "rayckpt_warm": "rayckpt load, page cache warm",
    "dcp_warm": "torch DCP load, page cache warm",
    "dcp_rayckpt_warm": "torch DCP API, rayckpt.dcp reader, page cache warm",
    "dcp_nocache": "torch DCP, s3fs without read-ahead",
}


def med(s: dict[str, Any]) -> float:
    return s["median"]


def targets(size: dict[str, Any], main_reshard: str, storage: str) -> list[dict[str, Any]]:
    """The target rows of one size: save, reshard load, then (local) throughput and memory, (S3) reads."""
    s, where = size["save"], "" if storage == "local" else " on S3"
    dcp_save, ray, sync = med(s["dcp"]["commit_s"]), s["rayckpt_ray"], med(s["rayckpt"]["commit_s"])
    ours = med(s["dcp_rayckpt"]["commit_s"])
    rows = [
        (f"save stall{where}: rayckpt Ray save_async / DCP save", med(ray["stall_s"]) / dcp_save, 0.2, False),
        (f"durable commit{where}: rayckpt Ray save_async / DCP save", med(ray["commit_s"]) / dcp_save, 1.0, False),
        (f"durable commit{where}: rayckpt.save (sync) / DCP save", sync / dcp_save, 1.0, False),
        (f"dcp.save{where}: rayckpt.dcp writer / DCP's writer", ours / dcp_save, 1.0, False),
        (f"dcp.save{where}: rayckpt.dcp writer / rayckpt.save", ours / sync, 1.15, False),
    ]
    ld = size["load"].get(main_reshard) or {}
    for mine, theirs, label in (
        ("rayckpt", "dcp", where),
        ("rayckpt_warm", "dcp_warm", ", page cache warm"),
        ("rayckpt", "dcp_nocache", " from S3, DCP without read-ahead"),
    ):
        if mine in ld and theirs in ld:
            ratio = med(ld[theirs]["wall_s"]) / med(ld[mine]["wall_s"])
            rows.append((f"reshard load {main_reshard}{label}: DCP time / rayckpt time", ratio, 1.5, True))
    for mine, theirs, label in (("dcp_rayckpt", "dcp", where), ("dcp_rayckpt_warm", "dcp_warm", ", page cache warm")):
        if mine in ld and theirs in ld:
            ratio = med(ld[mine]["wall_s"]) / med(ld[theirs]["wall_s"])
            rows.append((f"dcp.load {main_reshard}{label}: rayckpt.dcp reader / DCP's reader", ratio, 0.6, False))
    if storage == "s3":
        for name, entry in size["load"].items():
            for system in ("rayckpt", "dcp_rayckpt"):
                amp = statistics.median(entry[system]["read_amplification"])
                rows.append((f"read amplification, S3 reshard {name}: {LABELS[system]}", amp, READ_AMP_TARGET, False))
    else:
        raw = med(s["raw"]["commit_s"])
        rows.append(("persist throughput: rayckpt.save (sync) / raw write+fsync", raw / sync, 0.8, True))
        rows.append(("persist throughput: rayckpt Ray (commit - stall) / raw", raw / med(ray["persist_s"]), 0.8, True))
        mems = [(f"save {k}", s[k]["mem"]) for k in ("rayckpt", "rayckpt_ray")]
        mems += [(f"load {name}", entry.get("rayckpt", {}).get("mem")) for name, entry in size["load"].items()]
        worst = [(m["max_extra_rss_over_own"], at) for at, m in mems if m and m["max_extra_rss_over_own"] is not None]
        if worst:
            over, at = max(worst)
            name = f"memory: rayckpt rank peak extra RSS - own shard (worst: {at}), MiB"
            rows.append((name, over / MIB, MEM_BUFFER_BYTES / MIB, False))
        if ray.get("writer_mem"):
            name = "memory: ShardWriter actor peak extra private (anon) memory, MiB"
            rows.append((name, ray["writer_mem"]["max_extra_anon"] / MIB, MEM_BUFFER_BYTES / MIB, False))
    return [target(*row, "median over repeats of the slowest rank") for row in rows]


def markdown(report: dict[str, Any]) -> str:
    """The run: per size its save, load and target tables, then the planning section."""
    parts: list[Any] = []
    for key, size in report["sizes"].items():
        parts += [f"### {size['state_bytes'] / 1e9:.3f} GB state ({key}), {size['save_ranks']} ranks save"]
        parts += [save_rows(size), load_rows(size), targets_table(size["targets"])]
    plan = report.get("plan")
    if plan:
        bulk = plan["results"]["bulk_plan"]["wall"]["median"]
        c = plan["config"]
        name = f"planning {c['saved_ranks']} saved -> {c['target_ranks']} target ranks x {c['tensors']} tensors, s"
        parts += ["### Planning at scale (no I/O)", plan_rows(plan)]
        parts += [targets_table([target(name, bulk, PLAN_TARGET_S, False, "create_dim0_plans, all ranks")])]
    title = "Benchmarks" if report["config"]["storage"] == "local" else "Object storage"
    return document(title, report, *parts)


def save_rows(size: dict[str, Any]) -> list[str]:
    """The saves: stall, commit, memory and, on S3, the server's PUTs, per system."""
    rows = []
    for system, e in size["save"].items():
        if system in LABELS:
            m, sv = e["mem"] or {}, e.get("server") or {}
            rows.append(
                {"save": LABELS[system], "stall s": e["stall_s"], "commit s": e["commit_s"]}
                | {"GB/s": e["commit_s"].get("GBps_median"), "extra RSS MiB": mib(m.get("max_extra_rss"))}
                | {"anon+shm MiB": mib(m.get("max_extra_anon_shmem")), "PUTs": _median(sv.get("put_requests"))}
                | {"PUT MiB": mib(_median(sv.get("put_bytes")))}
            )
    w = size["save"]["rayckpt_ray"].get("writer_mem")
    if w:
        rows.append({"save": "ShardWriter actor (during save_async)", "extra RSS MiB": mib(w["max_extra_rss"])})
        rows[-1]["anon+shm MiB"] = mib(w["max_extra_anon_shmem"])
    raw, g = size["save"].get("raw_read"), size["save"].get("torch_save_gather")
    if raw:
        rows.append({"save": "raw disk cold read of the same bytes", "commit s": raw["wall_s"]})
    if g:
        rows.append({"save": "torch.save's full-state gather (once)", "commit s": g["wall_s"]})
        rows[-1]["extra RSS MiB"] = mib(g["rank0_extra_rss"])
    return table(rows)


def load_rows(size: dict[str, Any]) -> list[str]:
    """The reshard loads: time, bytes read against needed, requests, memory and the bit-exact check."""
    rows = []
    for name, ld in size["load"].items():
        for system, e in ((s, ld[s]) for s in LABELS if s in ld):
            m, info, gets = e["mem"] or {}, e.get("loadinfo") or {}, (e["server"] or {}).get("get_requests")
            rows.append(
                {"reshard": name, "load": LABELS[system], "load s": e["wall_s"], "GB/s": e["wall_s"].get("GBps_median")}
                | {"MiB read": mib(_median(e["bytes_read"])), "MiB needed": mib(sum(ld["bytes_needed_per_rank"]))}
                | {"read ampl.": _median(e["read_amplification"]), "GETs": _median(gets)}
                | {"LoadInfo GETs": _median(info.get("requests"))}
                | {"LoadInfo MiB": mib(_median(info.get("bytes_fetched")))}
                | {"extra RSS MiB": mib(m.get("max_extra_rss")), "anon+shm MiB": mib(m.get("max_extra_anon_shmem"))}
                | {"bit-exact tensors": e.get("verified_tensors")}
            )
    return table(rows)


def plan_rows(plan: dict[str, Any]) -> list[str]:
    """The planning run's steps (``benchmarks.micro plan``'s report)."""
    steps = plan["results"].values()
    return table([{"step": r["label"], "seconds": r["wall"], "peak MiB": mib(r["peak_extra_rss"])} for r in steps])


def _median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None
