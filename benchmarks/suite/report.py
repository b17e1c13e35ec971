"""The suite's report: targets as data and the Markdown tables."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common.harness import MIB, fmt, mib, run_line, table, target, targets_table

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
    "torch_save": "torch.save (rank 0, full state)",
    "raw": "raw disk (write + fsync)",
    "torch_load": "torch.load + set_state_dict (1 proc)",
    "rayckpt_warm": "rayckpt load, page cache warm",
    "dcp_warm": "torch DCP load, page cache warm",
    "dcp_nocache": "torch DCP, s3fs without read-ahead",
}


def med(s: dict[str, Any]) -> float:
    return s["median"]


def targets(size: dict[str, Any], main_reshard: str, storage: str) -> list[dict[str, Any]]:
    """The target rows of one size: save, reshard load, then (local) throughput and memory, (S3) reads."""
    s, where = size["save"], "" if storage == "local" else " on S3"
    dcp_save = med(s["dcp"]["commit_s"])
    rows = [
        target(
            f"save stall{where}: rayckpt Ray save_async / DCP save",
            med(s["rayckpt_ray"]["stall_s"]) / dcp_save,
            0.2,
            False,
            "median SaveHandle.stall_seconds (max over ranks) / median dcp.save",
        ),
        target(
            f"durable commit{where}: rayckpt Ray save_async / DCP save",
            med(s["rayckpt_ray"]["commit_s"]) / dcp_save,
            1.0,
            False,
            "median barrier-to-handle.wait() (max over ranks) / median dcp.save",
        ),
        target(
            f"durable commit{where}: rayckpt.save (sync) / DCP save",
            med(s["rayckpt"]["commit_s"]) / dcp_save,
            1.0,
            False,
            "median rayckpt.save / median dcp.save",
        ),
    ]
    ld = size["load"].get(main_reshard) or {}
    for mine, theirs, label in (
        ("rayckpt", "dcp", where),
        ("rayckpt_warm", "dcp_warm", ", page cache warm"),
        ("rayckpt", "dcp_nocache", " from S3, DCP without read-ahead"),
    ):
        if mine in ld and theirs in ld:
            ratio = med(ld[theirs]["wall_s"]) / med(ld[mine]["wall_s"])
            rows.append(
                target(
                    f"reshard load {main_reshard}{label}: DCP time / rayckpt time",
                    ratio,
                    1.5,
                    True,
                    "median load time (max over ranks) of DCP / rayckpt's",
                )
            )
    if storage == "s3":
        for name, entry in size["load"].items():
            amp = statistics.median(entry["rayckpt"]["read_amplification"])
            rows.append(
                target(
                    f"read amplification, S3 reshard {name}: rayckpt",
                    amp,
                    READ_AMP_TARGET,
                    False,
                    "object GET body bytes the server sent / payload bytes the ranks needed",
                )
            )
        return rows
    raw = med(s["raw"]["commit_s"])
    rows += [
        target(
            "persist throughput: rayckpt.save (sync) / raw write+fsync",
            raw / med(s["rayckpt"]["commit_s"]),
            0.8,
            True,
            "GB/s of rayckpt.save over GB/s of the raw write + fsync of the same bytes",
        ),
        target(
            "persist throughput: rayckpt Ray (commit - stall) / raw write+fsync",
            raw / med(s["rayckpt_ray"]["persist_s"]),
            0.8,
            True,
            "the background part of save_async over raw",
        ),
    ]
    worst = [
        (m["max_extra_rss_over_own"], f"save {k}")
        for k, m in ((k, s[k]["mem"]) for k in ("rayckpt", "rayckpt_ray"))
        if m and m["max_extra_rss_over_own"] is not None
    ]
    for name, entry in size["load"].items():
        m = entry.get("rayckpt", {}).get("mem")
        if m and m["max_extra_rss_over_own"] is not None:
            worst.append((m["max_extra_rss_over_own"], f"load {name}"))
    if worst:
        over, at = max(worst)
        rows.append(
            target(
                f"memory: rayckpt rank peak extra RSS - own shard (worst: {at}), MiB",
                over / MIB,
                MEM_BUFFER_BYTES / MIB,
                False,
                "peak RSS - RSS before - own shard bytes",
            )
        )
    w = s["rayckpt_ray"].get("writer_mem")
    if w:
        rows.append(
            target(
                "memory: ShardWriter actor peak extra private (anon) memory, MiB",
                w["max_extra_anon"] / MIB,
                MEM_BUFFER_BYTES / MIB,
                False,
                "its private memory",
            )
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The run: its line, per size the save, load and target tables, the planning section, the method."""
    lines = ["# Benchmarks" if report["storage"] == "local" else "## Object storage", "", run_line(report), ""]
    lines += [
        "Seconds: median (min-max) over repeats of the slowest rank; GB = 1e9 bytes; memory: peak extra RSS "
        "per rank, max over ranks and repeats (anon+shm: without file-backed pages)."
    ]
    for key, size in report["sizes"].items():
        lines += ["", f"## {size['state_bytes'] / 1e9:.3f} GB state ({key}), {report['storage']}", ""]
        lines += save_lines(size) + [""] + load_lines(size) + ["", "### Targets", ""]
        lines += targets_table(size["targets"])
    plan = report.get("plan")
    if plan:
        bulk = plan["results"]["bulk_plan"]["seconds"]["median"]
        c = plan["config"]
        lines += ["", "## Planning at scale (no I/O)", "", plan["markdown"].split("\n", 1)[1].strip(), ""]
        name = f"planning {c['saved_ranks']} saved -> {c['target_ranks']} target ranks x {c['tensors']} tensors, s"
        lines += targets_table([target(name, bulk, PLAN_TARGET_S, False, "create_dim0_plans, all ranks")])
    lines += ["", "## Method", "", *METHOD[report["storage"]]]
    return "\n".join(lines) + "\n"


def save_lines(size: dict[str, Any]) -> list[str]:
    rows = []
    for system, e in size["save"].items():
        if system not in LABELS:
            continue
        m, sv = e["mem"] or {}, e.get("server")
        puts = f"{statistics.median(sv['put_requests']):.0f} / {mib(statistics.median(sv['put_bytes']))}" if sv else ""
        rows.append(
            [
                LABELS[system],
                fmt(e["stall_s"], 3),
                fmt(e["commit_s"]),
                f"{e['commit_s'].get('GBps_median', 0):.2f}",
                mib(m.get("max_extra_rss")),
                mib(m.get("max_extra_anon_shmem")),
                puts,
            ]
        )
    w = size["save"]["rayckpt_ray"].get("writer_mem")
    if w:
        rows.append(
            [
                "ShardWriter actor (during save_async)",
                "",
                "",
                "",
                mib(w["max_extra_rss"]),
                mib(w["max_extra_anon_shmem"]),
                "",
            ]
        )
    lines = [f"### Save, {size['save_ranks']} ranks", ""]
    lines += table(["system", "stall s", "commit s", "GB/s", "extra RSS MiB", "anon+shm MiB", "PUTs / MiB"], rows)
    raw, g = size["save"].get("raw_read"), size["save"].get("torch_save_gather")
    if raw and g:
        lines += [
            "",
            f"Raw disk cold read of the same bytes: {fmt(raw['wall_s'])} s. torch.save's full-state gather "
            f"(once, not timed above): {g['wall_s']:.2f} s, rank 0 +{mib(g['rank0_extra_rss'])} MiB RSS.",
        ]
    return lines


def load_lines(size: dict[str, Any]) -> list[str]:
    rows = []
    for name, ld in size["load"].items():
        needed = sum(ld["bytes_needed_per_rank"])
        for system in LABELS:
            e = ld.get(system)
            if not e:
                continue
            m, sv, info = e["mem"] or {}, e.get("server"), e.get("loadinfo")
            gets = f"{statistics.median(sv['get_requests']):.0f}" if sv else ""
            own = (
                f"{statistics.median(info['requests']):.0f} / {mib(statistics.median(info['bytes_fetched']))}"
                if info
                else ""
            )
            amp = statistics.median(e["read_amplification"])
            rows.append(
                [
                    name,
                    LABELS[system],
                    fmt(e["wall_s"]),
                    f"{e['wall_s'].get('GBps_median', 0):.2f}",
                    f"{mib(statistics.median(e['bytes_read']))} / {mib(needed)} ({amp:.3f})",
                    gets,
                    own,
                    mib(m.get("max_extra_rss")),
                    mib(m.get("max_extra_anon_shmem")),
                    f"{e['verified_tensors']} tensors" if e.get("verified_tensors") else "no",
                ]
            )
    header = [
        "reshard",
        "system",
        "load s",
        "GB/s",
        "MiB read / needed (ampl.)",
        "GETs",
        "LoadInfo GETs / MiB",
        "extra RSS MiB",
        "anon+shm MiB",
        "bit-exact",
    ]
    return ["### Reshard loads", "", *table(header, rows)]


METHOD = {
    "local": [
        "- Each repeat runs every system once, in an order that rotates from repeat to repeat; times are "
        "barrier to barrier on gloo ranks (``rayckpt.testing.multiproc.run_ranks``), the max over ranks.",
        "- Stall: the time the calling rank is blocked (``SaveHandle.stall_seconds`` for ``save_async``, its "
        "staging buffer made before the repeats with ``prepare_staging``; until ``dcp.async_save`` returns). "
        "Commit: from the barrier before the call until the checkpoint is committed.",
        "- torch.save: the full state gathered to rank 0 once per size, then ``torch.save`` + fsync timed. "
        "Raw disk: each rank writes its 1/N of the bytes in 8 MiB blocks and fsyncs, then reads them back cold.",
        "- Loads: the checkpoint files fsynced and dropped from the page cache before each load; the 'page cache "
        "warm' rows read them into it first. The first load of each system goes into a zeroed state and is checked "
        "bit-exact. Read amplification: rayckpt's ``LoadInfo.bytes_read`` (DCP: ``rchar``) / bytes needed.",
        f"- Memory: /proc/self/status sampled in a thread during each operation; the target allows a rank its own "
        f"shard plus {MEM_BUFFER_BYTES // MIB} MiB.",
    ],
    "s3": [
        "- Endpoint: moto's S3 server in its own process on 127.0.0.1 behind ``benchmarks/suite/s3_counter.py``, "
        "which counts every request and its body bytes; rank 0 reads the counts around each operation, so both "
        "systems are counted by the server alike. Plain ranged GETs are served from the stored object's range.",
        "- rayckpt: ``s3://`` URIs (pyarrow's ``S3FileSystem``). DCP: ``FsspecWriter`` / ``FsspecReader`` on "
        "s3fs, a fresh instance per operation; loads also with s3fs's read-ahead off.",
        "- Saves and loads as on a local disk (rotated order, bit-exact first loads); the server is werkzeug's "
        "threaded development server on the same cores as the ranks: GET counts, bytes and read amplification "
        "do not depend on its speed, times do.",
    ],
}
