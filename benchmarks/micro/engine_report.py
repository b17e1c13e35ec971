"""``micro.engine``'s report: per-repeat figures, the JSON report and its markdown table.

Nothing here measures: it reduces the save and load ranks' records (wall = max over
ranks; median, min-max over repeats; GB/s over the state bytes) for each system the
ranks ran, the rayckpt / DCP time ratios, and the raw-disk anchor, then renders one
markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from benchmarks.common.harness import machine_info

LABELS = {"rayckpt": "rayckpt", "dcp": "torch DCP"}
RAW_PHASES = ("write_fsync", "write_cache", "read_cold")


def summarize(walls: list[float], nbytes: int) -> dict[str, Any]:
    med = statistics.median(walls)
    return {
        "seconds": walls,
        "median_s": med,
        "min_s": min(walls),
        "max_s": max(walls),
        "GBps_median": nbytes / 1e9 / med,
    }


def per_repeat(rank_results: list[dict[str, Any]], phase: str, system: str) -> list[dict[str, Any]]:
    """Per repeat: wall = max over ranks, plus per-rank figures."""
    reps = []
    for i in range(len(rank_results[0][phase][system])):
        rows = [r[phase][system][i] for r in rank_results]
        reps.append(
            {
                "wall_s": max(x["wall"] for x in rows),
                "own_s_per_rank": [round(x["own"], 4) for x in rows],
                "io_per_rank": [x["io"] for x in rows],
                **{
                    k: [x[k] for x in rows]
                    for k in ("bytes_needed", "bytes_read", "num_reads", "bytes_written", "num_files")
                    if k in rows[0]
                },
                **{k: rows[0][k] for k in ("resident_before_load",) if k in rows[0]},
            }
        )
    return reps


def fmt_s(s: dict[str, Any]) -> str:
    return f"{s['median_s']:.2f} ({s['min_s']:.2f}-{s['max_s']:.2f})"


def build_report(
    args: argparse.Namespace, cfg: dict[str, Any], saved: list[dict], loaded: list[dict], disk: dict
) -> dict:
    """The whole report: run, machine, setup times, per system figures, ratios, raw disk."""
    total = saved[0]["state_bytes"]
    systems = list(saved[0]["save"])
    report: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.micro", "engine", *sys.argv[1:]]),
        "config": {
            "size_mb": args.size_mb,
            "repeats": args.repeats,
            "save_ranks": args.save_ranks,
            "load_ranks": args.load_ranks,
            "layer_shapes_rows_cols": cfg["shapes"],
            "state_bytes": total,
            "dcp_writer": "FileSystemWriter defaults (single_file_per_rank, sync_files=True, thread_count=1)",
        },
        "machine": {
            **machine_info(),
            "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads_per_rank": saved[0].get("torch_threads"),
            "memcpy_GBps_1thread": saved[0].get("memcpy_GBps_1thread"),
        },
        "page_cache_eviction": {
            "method": "fsync + os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) on every checkpoint file",
            "used": bool(loaded[0].get("fadvise_used")),
        },
        "setup_s": {
            "save_side_build_per_rank": [round(r["build_s"], 2) for r in saved],
            "save_side_checksums_per_rank": [round(r["checksum_s"], 2) for r in saved],
            "load_side_build_two_models_per_rank": [round(r["build_s"], 2) for r in loaded],
            "load_side_verify": {s: round(loaded[0].get(f"verify_s_{s}", 0.0), 2) for s in systems},
        },
        "systems": {s: system_entry(s, saved, loaded, disk, total) for s in systems},
    }
    r, d = report["systems"]["rayckpt"], report["systems"]["dcp"]
    report["ratio_rayckpt_over_dcp"] = {
        phase: {
            "time_median_ratio": r[phase]["median_s"] / d[phase]["median_s"],
            "paired_time_ratios": [a / b for a, b in zip(r[phase]["seconds"], d[phase]["seconds"])],
        }
        for phase in ("save", "load")
    }
    report["raw_disk"] = raw_disk(saved, args.save_ranks)
    return report


def system_entry(system: str, saved: list[dict], loaded: list[dict], disk: dict, total: int) -> dict[str, Any]:
    """One system's save and load times, disk traffic and (rayckpt) read amplification."""
    save_reps = per_repeat(saved, "save", system)
    load_reps = per_repeat(loaded, "load", system)
    entry: dict[str, Any] = {
        "save": summarize([r["wall_s"] for r in save_reps], total),
        "load": summarize([r["wall_s"] for r in load_reps], total),
        "save_repeats": save_reps,
        "load_repeats": load_reps,
        "on_disk_bytes": disk[system][0],
        "on_disk_files": disk[system][1],
        "verified_tensors": loaded[0]["verified"].get(system),
    }
    disk_reads = [sum(x.get("read_bytes", 0) for x in r["io_per_rank"]) for r in load_reps]
    entry["disk_read_bytes_median"] = statistics.median(disk_reads)
    entry["disk_read_over_state"] = statistics.median(disk_reads) / total
    # Bytes the ranks pulled through read()-family syscalls (mmap'ed reads do not count here).
    syscall_reads = [sum(x.get("rchar", 0) for x in r["io_per_rank"]) for r in load_reps]
    entry["syscall_read_over_state"] = statistics.median(syscall_reads) / total
    writes = [sum(x.get("write_bytes", 0) for x in r["io_per_rank"]) for r in save_reps]
    entry["disk_write_bytes_median"] = statistics.median(writes)
    if system == "rayckpt":
        rep0 = load_reps[0]
        entry["read_amplification"] = sum(rep0["bytes_read"]) / max(sum(rep0["bytes_needed"]), 1)
        entry["bytes_read_per_rank"] = rep0["bytes_read"]
        entry["bytes_needed_per_rank"] = rep0["bytes_needed"]
    entry["resident_before_load"] = [r.get("resident_before_load") for r in load_reps]
    return entry


def raw_disk(saved: list[dict], processes: int) -> dict[str, Any]:
    """The raw-disk anchor: per repeat the slowest process of each phase, then their summaries."""
    raw_reps = []
    for i in range(len(saved[0]["raw"])):
        rows = [x["raw"][i] for x in saved]
        nbytes = sum(x["bytes"] for x in rows)
        raw_reps.append(
            {
                "bytes": nbytes,
                **{k: max(x[k]["wall"] for x in rows) for k in RAW_PHASES},
                "resident_before_read": [x["resident_before_read"] for x in rows],
            }
        )
    return {
        "bytes": raw_reps[0]["bytes"],
        "processes": processes,
        "repeats": raw_reps,
        **{k: summarize([x[k] for x in raw_reps], raw_reps[0]["bytes"]) for k in RAW_PHASES},
    }


def markdown(report: dict[str, Any]) -> str:
    """One table: save and load per system, their time ratios, the raw-disk anchor."""
    cfg, sysr = report["config"], report["systems"]
    n, m = cfg["save_ranks"], cfg["load_ranks"]
    raw = report["raw_disk"]
    lines = [
        f"State {cfg['state_bytes'] / 1e9:.3f} GB (fp32 params + AdamW exp_avg + exp_avg_sq, "
        f"{len(cfg['layer_shapes_rows_cols'])} FSDP2 Linear layers), save {n} ranks, load {m} ranks, "
        f"{cfg['repeats']} repeat(s), systems alternated; wall = barrier to barrier, max over ranks; "
        f"seconds as median (min-max); GB = 1e9 bytes. Machine: {report['machine']['nproc']} CPUs, "
        f"torch {report['machine']['torch']}. Page cache evicted before loads: "
        f"{'yes (fadvise DONTNEED)' if report['page_cache_eviction']['used'] else 'NO'}.",
        "",
        f"| system | save s | save GB/s | load {n}->{m} s | load GB/s | read amp. "
        "| disk read / state | on-disk bytes (files) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for system in sysr:
        e = sysr[system]
        if "read_amplification" in e:
            amp = f"{e['read_amplification']:.3f} (LoadInfo)"
        else:
            amp = f"{e['syscall_read_over_state']:.3f} (read() bytes)"
        lines.append(
            f"| {LABELS[system]} | {fmt_s(e['save'])} | {e['save']['GBps_median']:.2f} | {fmt_s(e['load'])} "
            f"| {e['load']['GBps_median']:.2f} | {amp} | {e['disk_read_over_state']:.3f} "
            f"| {e['on_disk_bytes']:,} ({e['on_disk_files']}) |"
        )
    ratio = report["ratio_rayckpt_over_dcp"]
    paired = {p: ", ".join(f"{x:.2f}" for x in ratio[p]["paired_time_ratios"]) for p in ("save", "load")}
    lines.append(
        f"| time ratio rayckpt / DCP (<1: rayckpt faster) | {ratio['save']['time_median_ratio']:.2f} "
        f"(per repeat {paired['save']}) | | {ratio['load']['time_median_ratio']:.2f} "
        f"(per repeat {paired['load']}) | | | | |"
    )
    lines.append(
        f"| raw disk ({n} procs, write+fsync / cold read) | {fmt_s(raw['write_fsync'])} "
        f"| {raw['write_fsync']['GBps_median']:.2f} | {fmt_s(raw['read_cold'])} "
        f"| {raw['read_cold']['GBps_median']:.2f} "
        f"| | | {raw['bytes']:,} ({n}) |"
    )
    lines.append(
        f"| raw disk ({n} procs, write into page cache) | {fmt_s(raw['write_cache'])} "
        f"| {raw['write_cache']['GBps_median']:.2f} | | | | | |"
    )
    lines.append("")
    lines.append(
        f"Single-thread memcpy: {report['machine']['memcpy_GBps_1thread']:.1f} GB/s. "
        "'disk read / state' = block-layer read_bytes (/proc/self/io, summed over ranks) / state bytes "
        "(ranks share the page cache, so a byte two ranks read counts once). Read amp.: rayckpt = sum "
        "LoadInfo.bytes_read / sum bytes_needed; DCP = bytes its ranks read via read() (rchar) / state bytes."
    )
    return "\n".join(lines)
