"""The incremental benchmark's arithmetic and tables: the ranks' records in, medians, ratios and Markdown out."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common.harness import MIB, fmt, run_line, summary, table, target, targets_table

SAVERS = ("full", "incremental", "dcp")
#: The targets (printed, not asserted): (state, what, incremental / full at most).
TARGETS = [
    ("frozen70", "bytes", 0.32),
    ("frozen70", "seconds", 0.45),
    ("lora99", "bytes", 0.02),
    ("lora99", "seconds", 0.10),
    ("dense", "seconds", 1.02),
]
#: The chained load's target: chained / self-contained at most.
CHAINED_LOAD_TARGET = 1.05


def merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's records with ``seconds`` the max over ranks."""
    out = []
    for i, rec in enumerate(per_rank[0]):
        out.append({**rec, "seconds": max(r[i]["seconds"] for r in per_rank)})
    return out


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
        out[saver] = {
            "first": {"seconds": recs[0]["seconds"], "bytes": recs[0]["bytes"]},
            "steady": {
                "seconds": summary([r["seconds"] for r in steady]),
                "bytes": summary([r["bytes"] for r in steady]),
            },
            "steady_phases_rank0": phase_medians(steady),
            "saves": len(recs),
        }

    def ratio(a: str, b: str, what: str) -> float:
        return out[a]["steady"][what]["median"] / out[b]["steady"][what]["median"]

    out["ratios"] = {
        "incremental_over_full_bytes": ratio("incremental", "full", "bytes"),
        "incremental_over_full_seconds": ratio("incremental", "full", "seconds"),
        "full_over_dcp_seconds": ratio("full", "dcp", "seconds"),
        "incremental_over_dcp_seconds": ratio("incremental", "dcp", "seconds"),
    }
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


def header(report: dict[str, Any]) -> list[str]:
    """The title, the command, the machine and versions, the load, and what was measured."""
    cfg = report["config"]
    states = "; ".join(
        f"`{k}` {v['state_bytes'] / MIB:,.0f} MiB, {v['frozen_bytes'] / v['state_bytes']:.1%} frozen"
        for k, v in report["layouts"].items()
    )
    return [
        "## Incremental saves against full saves and DCP",
        "",
        run_line(report),
        "",
        f"2 gloo ranks, an FSDP2 state (`nn.Linear` layers `fully_shard`-ed on the CPU; "
        "`model.state_dict()` and an `exp_avg` / `exp_avg_sq` DTensor per trained param, changed in place each "
        f"step). States: {states}. {cfg['steps']} steps, each saved by `full` (`rayckpt.save`, own `step-N` "
        "directory), `incremental` (`rayckpt.save(incremental=True)`) and `dcp` (`dcp.save`, own directory), "
        "the order rotated each step, after one untimed save of each elsewhere; every file evicted from the "
        "page cache after each save. Seconds: the "
        "save call, barrier before, max over ranks; MiB: the files the save created (incremental: its store "
        "files and its directory). First: step 1; steady: median (min-max) of steps 2.."
        f"{cfg['steps']}.",
        "",
    ]


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: saves, chained load, targets, rayckpt's phases."""
    lines, rows = header(report), []
    for state, s in report["states"].items():
        for saver in SAVERS:
            d, f, dc = s[saver], s["full"]["steady"], s["dcp"]["steady"]
            b, t = d["steady"]["bytes"]["median"], d["steady"]["seconds"]
            rows.append(
                [state, saver, f"{d['first']['bytes'] / MIB:,.1f}", f"{d['first']['seconds']:.3f}", f"{b / MIB:,.1f}",
                 fmt(t, 3), f"{b / f['bytes']['median']:.3f}", f"{t['median'] / f['seconds']['median']:.3f}",
                 f"{t['median'] / dc['seconds']['median']:.3f}"]
            )  # fmt: skip
    header_ = ["state", "saver", "first MiB", "first s", "steady MiB", "steady s", "x full MiB", "x full s", "x DCP s"]
    lines += table(header_, rows, right=7)
    ch = report.get("chain")
    if ch:
        cfg = report["config"]
        lines += [
            "",
            f"Chained load: `frozen70`, {cfg['chain']} incremental saves ({ch['chain_bytes'] / MIB:,.0f} MiB "
            "written in all) against one self-contained save of the last state "
            f"({ch['self_contained_bytes'] / MIB:,.0f} MiB); `rayckpt.load` of each, alternating, "
            f"{cfg['repeats']} times; cold: the files evicted first, warm: read in first. Seconds: median "
            "(min-max), max over ranks. Tensors differing bit for bit after the "
            f"first load: {ch['differing_tensors']}.",
            "",
        ]
        rows = [[c, fmt(ch[c]["chained"]["seconds"], 3), fmt(ch[c]["self-contained"]["seconds"], 3),
                 f"{ch[c]['ratio']:.3f}"] for c in ("cold", "warm")]  # fmt: skip
        lines += table(["load", "chained s", "self-contained s", "chained / self-contained"], rows, right=3)
    lines += ["", *targets_table(report["targets"])]
    lines += ["", "rayckpt's steady-state save phases (rank 0's `SaveInfo.phases`, medians, seconds):", ""]
    rows = []
    for state, s in report["states"].items():
        for saver in ("full", "incremental"):
            ph = s[saver]["steady_phases_rank0"]
            big = sorted(((k, v) for k, v in ph.items() if k != "total" and v >= 5e-4), key=lambda kv: -kv[1])
            rows.append([state, saver, f"{ph.get('total', 0.0):.3f}", ", ".join(f"{k} {v:.3f}" for k, v in big)])
    lines += table(["state", "saver", "total", "phases, largest first"], rows)
    return "\n".join(lines) + "\n"
