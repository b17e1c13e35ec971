"""The incremental benchmark's arithmetic and tables: the ranks' records in, medians, ratios and Markdown out."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common.harness import MIB, document, summary, table, target

SAVERS = ("full", "incremental", "dcp")
#: The targets (printed, not asserted): (state, what, incremental / full at most).
TARGETS = [("frozen70", "bytes", 0.32), ("frozen70", "seconds", 0.45), ("lora99", "bytes", 0.02)]
TARGETS += [("lora99", "seconds", 0.10), ("dense", "seconds", 1.02)]
#: The chained load's target: chained / self-contained at most.
CHAINED_LOAD_TARGET = 1.05


def merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's records with ``seconds`` the max over ranks."""
    return [{**rec, "seconds": max(r[i]["seconds"] for r in per_rank)} for i, rec in enumerate(per_rank[0])]


def phase_medians(recs: list[dict[str, Any]]) -> dict[str, float]:
    """Each phase's median over the records (0 where a record lacks it)."""
    keys = {k for r in recs for k in r.get("phases", {})}
    return {k: statistics.median(r.get("phases", {}).get(k, 0.0) for r in recs) for k in keys}


def summarize_state(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per saver: the first save, and the steady state (steps 2..N) as medians; the ratios between savers."""
    out: dict[str, Any] = {}
    for saver in SAVERS:
        recs = [r for r in records if r["saver"] == saver]
        steady = [r for r in recs if r["step"] > 1] or recs
        out[saver] = {"first": {k: recs[0][k] for k in ("seconds", "bytes")}, "saves": len(recs)}
        out[saver]["steady"] = {k: summary([r[k] for r in steady]) for k in ("seconds", "bytes")}
        out[saver]["steady_phases_rank0"] = phase_medians(steady)

    def ratio(a: str, b: str, what: str) -> float:
        return out[a]["steady"][what]["median"] / out[b]["steady"][what]["median"]

    pairs = [("incremental", "full", "bytes"), ("incremental", "full", "seconds"), ("full", "dcp", "seconds")]
    pairs.append(("incremental", "dcp", "seconds"))
    out["ratios"] = {f"{a}_over_{b}_{what}": ratio(a, b, what) for a, b, what in pairs}
    return out


def summarize_chain(result: dict[str, Any]) -> dict[str, Any]:
    """Medians of each load kind, cold and warm, and chained / self-contained."""
    out: dict[str, Any] = {"differing_tensors": result["differing_tensors"]}
    for cache in ("cold", "warm"):
        row = {}
        for kind in ("chained", "self-contained"):
            recs = [r for r in result["loads"] if r["kind"] == kind and r["cache"] == cache]
            row[kind] = {"seconds": summary([r["seconds"] for r in recs]), "phases_rank0": phase_medians(recs)}
        row["ratio"] = row["chained"]["seconds"]["median"] / row["self-contained"]["seconds"]["median"]
        out[cache] = row
    saves = result["saves"]
    out["chain_bytes"] = sum(r["bytes"] for r in saves[:-1])
    out["self_contained_bytes"] = saves[-1]["bytes"]
    return out


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The target rows (``harness.target``) of the states and the chained load the run measured."""
    rows = []
    for state, what, threshold in TARGETS:
        if state in report["states"]:
            measured = report["states"][state]["ratios"][f"incremental_over_full_{what}"]
            rows.append(target(f"{state}: incremental / full, steady {what}", measured, threshold, False, "median"))
    if report.get("chain"):
        for cache in ("cold", "warm"):
            measured = report["chain"][cache]["ratio"]
            name = f"{cache} load: chained / self-contained"
            rows.append(target(name, measured, CHAINED_LOAD_TARGET, False, "median"))
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: saves, chained load, targets, rayckpt's phases."""
    rows, phases = [], []
    for state, s in report["states"].items():
        full, dcp = s["full"]["steady"], s["dcp"]["steady"]
        for saver in SAVERS:
            first, steady = s[saver]["first"], s[saver]["steady"]
            b, t = steady["bytes"]["median"], steady["seconds"]
            rows.append(
                {"state": state, "saver": saver, "first MiB": first["bytes"] / MIB, "first s": first["seconds"]}
                | {"steady MiB": b / MIB, "steady s": t, "x full MiB": b / full["bytes"]["median"]}
                | {
                    "x full s": t["median"] / full["seconds"]["median"],
                    "x DCP s": t["median"] / dcp["seconds"]["median"],
                }
            )
        for saver in ("full", "incremental"):
            ph = s[saver]["steady_phases_rank0"]
            big = sorted(((k, v) for k, v in ph.items() if k != "total" and v >= 5e-4), key=lambda kv: -kv[1])
            phases.append({"state": state, "saver": saver, "rank 0's phases, s": ph.get("total", 0.0)})
            phases[-1]["largest first"] = ", ".join(f"{k} {v:.3f}" for k, v in big)
    ch, parts = report.get("chain"), []
    if ch:
        loads = [
            {"load": c, "chained s": ch[c]["chained"]["seconds"]}
            | {"self-contained s": ch[c]["self-contained"]["seconds"], "chained / self-contained": ch[c]["ratio"]}
            for c in ("cold", "warm")
        ]
        parts = [
            f"Chained load: {ch['chain_bytes'] / MIB:,.0f} MiB written by the chain, "
            f"{ch['self_contained_bytes'] / MIB:,.0f} MiB by the self-contained save; tensors differing bit for bit "
            f"after the first load: {ch['differing_tensors']}.",
            table(loads),
        ]
    return document("Incremental saves against full saves and DCP", report, table(rows), *parts, table(phases))
