"""The overlap benchmarks' arithmetic and tables: per-rank records in, medians, ratios and Markdown out."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common.harness import document, grouped, summary, table, target

#: The stall targets: rayckpt's at most this fraction of DCP's (``--plain``: DCP's), and under this many seconds.
STALL_OVER_DCP, PLAIN_STALL_OVER_DCP, STALL_SECONDS = 0.25, 1.0, 0.03
#: A data position costs nothing measurable: a median stall within the rounds' spread without, 0.1% more bytes.
DATA_STALL, DATA_BYTES = 1.0, 1.001


def summarize_stall(records: list[dict[str, Any]], errors: dict[str, str] | None = None) -> dict[str, Any]:
    """Per mode: the stall of each round's slowest rank and of its median rank, over rounds."""
    out: dict[str, Any] = {}
    for mode, mine in grouped(records, "mode").items():
        recs = list(grouped(mine, "round").values())
        copies = [max(r["copy_s"] for r in rs) for rs in recs if all(r["copy_s"] is not None for r in rs)]
        m = {"stall_slowest": summary([max(r["stall_s"] for r in rs) for rs in recs])}
        m["stall_rank_median"] = summary([statistics.median(r["stall_s"] for r in rs) for rs in recs])
        m["step_waited_s"] = statistics.median(max(r["staged_wait_s"] + r["opt_wait_s"] for r in rs) for rs in recs)
        m["total_s"] = statistics.median(max(r["total_s"] for r in rs) for rs in recs)
        m |= {"copy_s": statistics.median(copies) if copies else None, "ranks": len(recs[0]), "rounds": len(recs)}
        m["ckpt_bytes"] = statistics.median(max(r.get("ckpt_bytes", 0) for r in rs) for rs in recs)
        out[mode] = m | {"late_bytes": max(r["late_bytes"] for rs in recs for r in rs)}
    for mode, error in (errors or {}).items():
        out[mode] = {"error": error}
    return out


def stall_ratio(modes: dict[str, Any], mode: str, to: str) -> float | None:
    """``mode``'s median slowest-rank stall over ``to``'s (``None`` where either has none)."""
    a, b = modes.get(mode, {}).get("stall_slowest"), modes.get(to, {}).get("stall_slowest")
    if a is None or b is None or b["median"] <= 0:
        return None
    return a["median"] / b["median"]


def stall_targets(scenarios: dict[str, dict[str, Any]], plain: bool = False) -> list[dict[str, Any]]:
    """Per scenario: rayckpt's stall over DCP's, and (not ``plain``) its stall in seconds, against the targets."""
    rows = []
    for name, modes in scenarios.items():
        ratio, most = stall_ratio(modes, "rayckpt", "dcp"), PLAIN_STALL_OVER_DCP if plain else STALL_OVER_DCP
        rows.append(target(f"{name}: stall, rayckpt / DCP", ratio, most, False, "slowest rank, median"))
        measured = modes.get("rayckpt", {}).get("stall_slowest", {}).get("median")
        if not plain:
            rows.append(target(f"{name}: stall, rayckpt, s", measured, STALL_SECONDS, False, "the same, in seconds"))
        if "rayckpt-data" in modes:
            d, r = modes["rayckpt-data"], modes["rayckpt"]
            spread = d["stall_slowest"]["median"] / r["stall_slowest"]["max"]
            rows.append(target(f"{name}: stall, with data position / slowest without", spread, DATA_STALL, False, ""))
            grown = d.get("ckpt_bytes", 0) / max(1, r.get("ckpt_bytes", 0))
            rows.append(target(f"{name}: checkpoint bytes, with / without", grown, DATA_BYTES, False, "median"))
    return rows


def stall_markdown(report: dict[str, Any]) -> str:
    """The stall report: one row per scenario and mode, the targets."""
    rows = []
    for name, modes in report["summary"].items():
        for mode, m in modes.items():
            row = {"scenario": name, "mode": mode, "stall s, slowest rank": m.get("error", m.get("stall_slowest"))}
            if "error" in m:
                rows.append(row)
                continue
            rows.append(
                row
                | {"stall s, median rank": m["stall_rank_median"]["median"], "x DCP": stall_ratio(modes, mode, "dcp")}
                | {"x copy": stall_ratio(modes, mode, "copy")}
                | {"step waited s": m["step_waited_s"], "save to done s": m["total_s"]}
                | {"copied after the call, MiB": m["late_bytes"] / 2**20 if m["late_bytes"] else None}
                | {"checkpoint bytes": m.get("ckpt_bytes") or None}
            )
    return document("Save stall beside training: the time the save call blocks", report, table(rows))


def summarize_step(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per save interval and mode: the slowest worker's step, median and mean over the steps past each
    round's first; the save call and the waits before the optimizer step; memory saves skipped."""
    out: dict[str, Any] = {}
    for every, interval in grouped(records, "every").items():
        out[str(every)] = {}
        for mode, mine in grouped(interval, "mode").items():
            steps = list(grouped(mine, "step").values())
            counted = [rs for rs in steps if rs[0]["i"] > 0]
            slowest = [max(r["step_s"] for r in rs) for rs in counted]
            saves = [rs for rs in steps if rs[0]["saved"]]
            calls = [max(r["save_s"] for r in rs) for rs in saves if rs[0]["i"] > 0 and not rs[0]["skipped"]]
            waits = [max(r["wait_s"] for r in rs) for rs in counted]
            m = {"step_median_s": statistics.median(slowest), "step_mean_s": statistics.fmean(slowest)}
            m |= {"steps": len(counted), "save_call_s": statistics.median(calls) if calls else None}
            m |= {"wait_mean_s": statistics.fmean(waits), "wait_total_s": sum(waits), "saves": len(saves)}
            out[str(every)][mode] = m | {"skipped": sum(bool(rs[0]["skipped"]) for rs in saves)}
    return out


def step_markdown(report: dict[str, Any]) -> str:
    """The step report: one row per save interval and mode."""
    rows = []
    for every, modes in report["summary"].items():
        none, copy = modes.get("none"), modes.get("copy")
        for mode, m in modes.items():
            med, mean = m["step_median_s"], m["step_mean_s"]
            rows.append(
                {"save every": int(every), "mode": mode, "step s, median": med}
                | {"x none": med / none["step_median_s"] if none else None}
                | {"x copy": med / copy["step_median_s"] if copy else None, "step s, mean": mean}
                | {"mean x none": mean / none["step_mean_s"] if none else None, "save call s": m["save_call_s"]}
                | {"waited s per step": m["wait_mean_s"]}
                | {"memory saves skipped": f"{m['skipped']} of {m['saves']}" if mode.startswith("memory") else None}
            )
    notes = [f"- {note}" for note in report.get("notes", [])]
    return document("Step time with a save beside training", report, table(rows), notes)
