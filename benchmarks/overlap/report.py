"""The overlap benchmarks' arithmetic and tables: per-rank records in, medians, ratios and Markdown out."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from benchmarks.common.harness import run_line, summary, table, target, targets_table

#: The stall targets: rayckpt's stall at most this fraction of DCP's, and under this many seconds.
STALL_OVER_DCP = 0.25
STALL_SECONDS = 0.03


#: What each mode of ``stall`` does, for its table.
STALL_MODES = {
    "copy": "every local tensor copied into host buffers allocated beforehand",
    "dcp": "`async_save` with one reused `DefaultStager(StagingOptions(True, False, False, False))`",
    "dcp-async-staging": "the same with `StagingOptions(True, True, True, True)`, its staging waited for before "
    "the optimizer step",
    "rayckpt-sync": "`save_async(overlap=False)`",
    "rayckpt": "`save_async` (overlap: the optimizer's tensors copied beside the next step)",
    "rayckpt-all": '`save_async(overlap="all")`',
}


def summarize_stall(records: list[dict[str, Any]], errors: dict[str, str] | None = None) -> dict[str, Any]:
    """Per mode: the stall of each round's slowest rank and of its median rank, over rounds."""
    by_round: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_round[r["mode"]][r["round"]].append(r)
    out: dict[str, Any] = {}
    for mode, rounds in by_round.items():
        recs = [rounds[k] for k in sorted(rounds)]
        copies = [max(r["copy_s"] for r in rs) for rs in recs if all(r["copy_s"] is not None for r in rs)]
        out[mode] = {
            "stall_slowest": summary([max(r["stall_s"] for r in rs) for rs in recs]),
            "stall_rank_median": summary([statistics.median(r["stall_s"] for r in rs) for rs in recs]),
            "step_waited_s": statistics.median(max(r["staged_wait_s"] + r["opt_wait_s"] for r in rs) for rs in recs),
            "total_s": statistics.median(max(r["total_s"] for r in rs) for rs in recs),
            "copy_s": statistics.median(copies) if copies else None,
            "late_bytes": max(r["late_bytes"] for rs in recs for r in rs),
            "ranks": len(recs[0]),
            "rounds": len(recs),
        }
    for mode, error in (errors or {}).items():
        out[mode] = {"error": error}
    return out


def stall_ratio(modes: dict[str, Any], mode: str, to: str) -> float | None:
    """``mode``'s median slowest-rank stall over ``to``'s (``None`` where either has none)."""
    a, b = modes.get(mode, {}).get("stall_slowest"), modes.get(to, {}).get("stall_slowest")
    if a is None or b is None or b["median"] <= 0:
        return None
    return a["median"] / b["median"]


def stall_targets(scenarios: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario: rayckpt's stall over DCP's, and rayckpt's stall in seconds, against the targets."""
    rows = []
    for name, modes in scenarios.items():
        rows.append(
            target(
                f"{name}: stall, rayckpt / DCP",
                stall_ratio(modes, "rayckpt", "dcp"),
                STALL_OVER_DCP,
                False,
                "the slowest rank's stall, median over rounds",
            )
        )
        measured = modes.get("rayckpt", {}).get("stall_slowest", {}).get("median")
        rows.append(target(f"{name}: stall, rayckpt, s", measured, STALL_SECONDS, False, "the same, in seconds"))
    return rows


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def stall_markdown(report: dict[str, Any]) -> str:
    """The stall report: the run, one row per scenario and mode, the targets."""
    shape, args = report["shape"], report["args"]
    held = "plain tensors (copies of the app's, no optimizer's)" if args.get("plain") else "`AppState(model, opt)`"
    lines = [
        "## Save stall beside training: the time the save call blocks",
        "",
        run_line(report),
        "",
        f"State: {report['state_bytes'] / 2**30:.3f} GiB on {report['machine']['device']} (fp32 params + AdamW "
        f"exp_avg + exp_avg_sq of {shape['layers']} square `nn.Linear` layers {shape['width']} wide); "
        f"`one-process`: one process holds all of it, as {held}; `four-ranks`: {args['workers']} "
        "TorchTrainer workers (gloo; one all-gather a step), the stack FSDP2-sharded, each holding "
        f"1/{args['workers']}. "
        "Each save: the call timed, one training "
        f"step ({args['batch']} rows: forward, backward, AdamW step; an overlapped copy runs beside forward and "
        "backward and the step waits for what is left of it), then the save waited for (DCP: its upload; "
        "rayckpt: its commit) and removed. Modes: "
        + "; ".join(f"`{m}`: {STALL_MODES[m]}" for m in report.get("modes", STALL_MODES) if m in STALL_MODES)
        + f"; rayckpt after `prepare_staging`. {args['rounds']} rounds after "
        f"{args['warmup']} warm-up round(s), modes rotated; seconds: the slowest rank's per round (and the median "
        "rank's), median (min-max) over rounds.",
        "",
    ]
    rows = []
    for name, modes in report["summary"].items():
        for mode, m in modes.items():
            if "error" in m:
                rows.append([name, mode, m["error"], *[""] * 6])
                continue
            s, med = m["stall_slowest"], m["stall_rank_median"]
            rows.append(
                [name, mode, f"{s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f})", f"{med['median']:.4f}",
                 _ratio(stall_ratio(modes, mode, "dcp")), _ratio(stall_ratio(modes, mode, "copy")),
                 f"{m['step_waited_s']:.3f}", f"{m['total_s']:.2f}",
                 f"{m['late_bytes'] / 2**20:,.0f} MiB" if m["late_bytes"] else ""]
            )  # fmt: skip
    header = ["scenario", "mode", "stall s, slowest rank", "stall s, median rank", "x DCP", "x copy"]
    lines += table([*header, "step waited s", "save to done s", "copied after the call"], rows, right=7)
    lines += ["", *targets_table(report["targets"])]
    if report.get("notes"):
        lines += [""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


#: What each mode of ``step`` does, for its table.
STEP_MODES = {
    "none": "no save",
    "copy": "each worker's share copied into buffers made beforehand",
    "dcp": "`async_save` with a reused pinned `DefaultStager`, its staging waited for before the optimizer step, "
    "the previous upload before the next save",
    "memory": "`Checkpointer(memory_every=1).save(step, state, persist=False)` (overlap by default)",
    "memory-sync": "the same with `Checkpointer(overlap=False)`",
}


def summarize_step(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per save interval and mode: the slowest worker's step, median and mean over the steps past each
    round's first; the save call and the waits before the optimizer step; memory saves skipped."""
    by_step: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[(r["every"], r["step"])].append(r)
    grouped: dict[int, dict[str, list[list[dict[str, Any]]]]] = defaultdict(lambda: defaultdict(list))
    for (every, _), rs in sorted(by_step.items()):
        grouped[every][rs[0]["mode"]].append(rs)
    out: dict[str, Any] = {}
    for every, modes in grouped.items():
        out[str(every)] = {}
        for mode, steps in modes.items():
            counted = [rs for rs in steps if rs[0]["i"] > 0]
            slowest = [max(r["step_s"] for r in rs) for rs in counted]
            saves = [rs for rs in steps if rs[0]["saved"]]
            calls = [max(r["save_s"] for r in rs) for rs in saves if rs[0]["i"] > 0 and not rs[0]["skipped"]]
            waits = [max(r["wait_s"] for r in rs) for rs in counted]
            out[str(every)][mode] = {
                "step_median_s": statistics.median(slowest),
                "step_mean_s": statistics.fmean(slowest),
                "steps": len(counted),
                "save_call_s": statistics.median(calls) if calls else None,
                "wait_mean_s": statistics.fmean(waits),
                "wait_total_s": sum(waits),
                "saves": len(saves),
                "skipped": sum(bool(rs[0]["skipped"]) for rs in saves),
            }
    return out


def step_markdown(report: dict[str, Any]) -> str:
    """The step report: the run, one row per save interval and mode."""
    shape, args = report["shape"], report["args"]
    lines = [
        "## Step time with a save beside training",
        "",
        run_line(report),
        "",
        f"State: {report['state_bytes'] / 2**30:.3f} GiB (fp32 params + AdamW exp_avg + exp_avg_sq of "
        f"{shape['layers']} square `nn.Linear` layers {shape['width']} wide), FSDP2-sharded over "
        f"{args['workers']} TorchTrainer workers (gloo, CPU; one all-gather a step), as `AppState(model, opt)`. "
        "A step: "
        f"the save when one is due, then forward and backward of {args['batch']} rows per worker and the AdamW "
        "step (what a save costs the training beside it counts in its own step). Modes: "
        + "; ".join(f"`{m}`: {STEP_MODES[m]}" for m in report.get("modes", STEP_MODES) if m in STEP_MODES)
        + f". {args['rounds']} rounds of every mode, {args['steps']} steps each, order rotated; step s: the slowest "
        "worker's, median and mean over the steps past each round's first; save call s: median over those "
        "steps' saves; waited: seconds before the optimizer step (DCP's staging, an overlapped copy), per step.",
        "",
    ]
    rows = []
    for every, modes in report["summary"].items():
        none, copy = modes.get("none"), modes.get("copy")
        for mode, m in modes.items():
            rows.append(
                [every, mode, f"{m['step_median_s']:.3f}",
                 _ratio(m["step_median_s"] / none["step_median_s"]) if none else "",
                 _ratio(m["step_median_s"] / copy["step_median_s"]) if copy else "", f"{m['step_mean_s']:.3f}",
                 _ratio(m["step_mean_s"] / none["step_mean_s"]) if none else "",
                 "" if m["save_call_s"] is None else f"{m['save_call_s']:.4f}", f"{m['wait_mean_s']:.4f}",
                 f"{m['skipped']} of {m['saves']}" if mode.startswith("memory") else ""]
            )  # fmt: skip
    header = ["save every", "mode", "step s, median", "x none", "x copy", "step s, mean", "mean x none"]
    lines += table([*header, "save call s", "waited s per step", "memory saves skipped"], rows, right=8)
    if report.get("notes"):
        lines += [""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"
