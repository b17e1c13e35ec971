"""The scale benchmark's figures: series per rank count, growth exponents, the targets, markdown."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.common.harness import cell, document, table, target

GIB = 2**30
#: The rank count the targets name.
TARGET_RANKS = 4096


def fit_exponent(points: list[tuple[float, float]]) -> float:
    """The slope of log(value) against log(ranks), least squares: value ~ ranks ** slope."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(v) for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def _get(d: Any, *path: Any) -> Any:
    for p in path:
        if not isinstance(d, dict) or "error" in d:
            return None
        d = d.get(str(p) if isinstance(p, int) else p)
    return d


def _sum(*values: Any) -> float | None:
    return None if any(v is None for v in values) else float(sum(values))


def _scaled(step: Any, *path: Any) -> float | None:
    """A figure of a step that sampled the tensors (``scale`` = full chunks / sampled chunks), scaled up."""
    v = _get(step, *path)
    return None if v is None else v * float(step.get("scale", 1.0))


def _sampled(*steps: Any) -> bool:
    return any(isinstance(s, dict) and s.get("scale", 1.0) > 1 for s in steps)


def figures(r: dict[str, Any], n: int) -> dict[str, Any]:
    """One rank count's figures, by name (CPU seconds, bytes); None where a step did not run."""
    rc, rl, rs = r.get("rayckpt_commit", {}), r.get("rayckpt_load", {}), r.get("rayckpt_save_plan", {})
    dc, dl, ds = r.get("dcp_commit", {}), r.get("dcp_load", {}), r.get("dcp_save_plan", {})
    half, minus = max(1, n // 2), max(1, n - 1)
    f: dict[str, Any] = {"rayckpt_est": _sampled(rc, rl), "dcp_est": _sampled(dc, dl)}
    for system, commit, load in (("rayckpt", rc, rl), ("dcp", dc, dl)):  # the manifest steps (maybe sampled)
        f[f"{system}_bytes"], f[f"{system}_chunks"] = _scaled(commit, "metadata_bytes"), _scaled(commit, "chunks")
        f[f"{system}_read"] = _scaled(load, "read", "cpu_s")
    f |= {"rayckpt_create": _scaled(rc, "create_manifest", "cpu_s"), "rayckpt_write": _scaled(rc, "commit", "cpu_s")}
    f["dcp_write"] = _scaled(dc, "write", "cpu_s")
    f |= {
        "rayckpt_save_plan": _get(rs, "save_plan", "cpu_s"),
        "rayckpt_save_plan_cached": _get(rs, "cached_save_plan", "cpu_s"),
    }
    f |= {"dcp_save_plan": _get(ds, "uncached", "cpu_s"), "dcp_save_plan_est": bool(_get(ds, "uncached", "estimated"))}
    f["dcp_save_plan_cached"] = _get(ds, "cached", "cpu_s")
    for tag, m in (("half", half), ("minus", minus)):
        table = _scaled(rl, "chunk_table", "cpu_s")
        f[f"rayckpt_job_{tag}"] = _sum(table, _scaled(rl, "targets", m, "bulk_plan", "cpu_s"))
        # One rank without Ray: its plan from the slice rank 0 scattered (it reads no manifest).
        f[f"rayckpt_rank_{tag}"] = _scaled(rl, "targets", m, "from_slice", "cpu_s")
        f[f"rayckpt_root_{tag}"] = _sum(f[f"rayckpt_job_{tag}"], _scaled(rl, "targets", m, "slices", "cpu_s"))
        f[f"dcp_job_{tag}"] = _scaled(dl, "targets", m, "whole_job", "cpu_s")
        f[f"dcp_job_{tag}_est"] = bool(_get(dl, "targets", m, "whole_job", "estimated")) or f["dcp_est"]
        f[f"dcp_rank_{tag}"] = _sum(f["dcp_read"], _scaled(dl, "targets", m, "rank_plan", "cpu_s"))
    f["dcp_rank_plan_half"] = _scaled(dl, "targets", half, "rank_plan", "cpu_s")  # one rank's plan, no read
    f["rayckpt_for_rank_half"] = _get(rl, "targets", half, "for_rank", "cpu_s")
    mems = [_scaled(rc, "create_manifest", "extra_rss"), _scaled(rc, "commit", "extra_rss")]
    mems += [_scaled(rl, step, "extra_rss") for step in ("read", "chunk_table")] + [_get(rs, "save_plan", "extra_rss")]
    mems += [_scaled(rl, "targets", m, "bulk_plan", "extra_rss") for m in (half, minus)]
    f["rayckpt_peak_extra"] = max((m for m in mems if m is not None), default=None)
    dmems = [_scaled(dc, "write", "extra_rss"), _scaled(dl, "read", "extra_rss"), _get(ds, "uncached", "extra_rss")]
    f["dcp_peak_extra"] = max((m for m in dmems if m is not None), default=None)
    return f


#: The figures whose growth in N is fitted (``fit_exponents``).
FITTED = ("rayckpt_bytes", "dcp_bytes", "rayckpt_read", "dcp_read", "rayckpt_save_plan", "dcp_save_plan")
FITTED += ("rayckpt_job_half", "dcp_job_half", "rayckpt_rank_half", "dcp_rank_half")


def all_figures(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(n): figures(r, int(n)) for n, r in sorted(report["results"].items(), key=lambda kv: int(kv[0]))}


def fit_exponents(report: dict[str, Any]) -> dict[str, Any]:
    """Each of ``FITTED``: its growth exponent over the rank counts measured, and its points."""
    figs, out = all_figures(report), {}
    for key in FITTED:
        pts = [(n, f[key]) for n, f in figs.items() if f[key] and f[key] > 0]
        out[key] = {"exponent": fit_exponent(pts) if len(pts) >= 2 else None, "points": pts}
    return out


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, each met / not met (None: not measured)."""
    figs = all_figures(report)
    big = figs.get(TARGET_RANKS, {})
    ratios = [f["rayckpt_bytes"] / f["dcp_bytes"] for f in figs.values() if f["rayckpt_bytes"] and f["dcp_bytes"]]
    speedups = [f["dcp_read"] / f["rayckpt_read"] for f in figs.values() if f["rayckpt_read"] and f["dcp_read"]]
    ours, cached = big.get("rayckpt_save_plan_cached"), big.get("dcp_save_plan_cached")
    peak = big.get("rayckpt_peak_extra")
    rows = [
        ("manifest / DCP .metadata, every N", max(ratios, default=None), 0.5, "largest ratio over N"),
        ("global save plan at 4,096 ranks (s)", big.get("rayckpt_save_plan"), 2.0, "CPU s"),
        ("cached save plan / DCP cached at 4,096", ours / cached if ours is not None and cached else None, 1.0, ""),
        ("load plan 4,096 -> 2,048, whole job (s)", big.get("rayckpt_job_half"), 1.0, "table + bulk plans"),
        ("load plan 4,096 -> 2,048, one rank without Ray (s)", big.get("rayckpt_rank_half"), 0.1, "from its slice"),
        ("coordinator peak extra memory at 4,096 (GiB)", peak / GIB if peak else None, 2.0, "largest step"),
    ]
    for key in ("rayckpt_bytes", "rayckpt_save_plan", "rayckpt_job_half", "rayckpt_rank_half"):
        exponent = report.get("fits", {}).get(key, {}).get("exponent")
        rows.append((f"growth exponent: {ROWS[key][0]}", exponent, 1.1, "log-log least squares over N"))
    speedup = target("read + parse speed-up over DCP unpickle", min(speedups, default=None), 5.0, True, "smallest")
    return [speedup] + [target(name, value, goal, False, how) for name, value, goal, how in rows]


#: The table's rows: figure -> (label, unit divisor, the figure saying it was estimated).
ROWS = {
    "rayckpt_chunks": ("chunks, rayckpt", 1, "rayckpt_est"),
    "dcp_chunks": ("chunks, DCP", 1, "dcp_est"),
    "rayckpt_bytes": ("metadata MB, rayckpt (manifest + chunk table)", 1e6, "rayckpt_est"),
    "dcp_bytes": ("metadata MB, DCP (.metadata)", 1e6, "dcp_est"),
    "rayckpt_create": ("create manifest s, rayckpt", 1, "rayckpt_est"),
    "rayckpt_write": ("write s, rayckpt", 1, "rayckpt_est"),
    "dcp_write": ("pickle + write s, DCP", 1, "dcp_est"),
    "rayckpt_read": ("read + parse s, rayckpt", 1, "rayckpt_est"),
    "dcp_read": ("read + unpickle s, DCP", 1, "dcp_est"),
    "rayckpt_save_plan": ("global save plan s, rayckpt (rank 0's `assign_writers`)", 1, None),
    "dcp_save_plan": ("global save plan s, DCP uncached", 1, "dcp_save_plan_est"),
    "rayckpt_save_plan_cached": ("cached save plan s, rayckpt (digest of the layout hashes)", 1, None),
    "dcp_save_plan_cached": ("cached save plan s, DCP", 1, None),
    "rayckpt_job_minus": ("load plan N -> N-1, whole job s, rayckpt (table + bulk plan)", 1, "rayckpt_est"),
    "dcp_job_minus": ("load plan N -> N-1, whole job s, DCP", 1, "dcp_job_minus_est"),
    "rayckpt_job_half": ("load plan N -> N/2, whole job s, rayckpt", 1, "rayckpt_est"),
    "dcp_job_half": ("load plan N -> N/2, whole job s, DCP", 1, "dcp_job_half_est"),
    "rayckpt_rank_minus": ("load plan N -> N-1, one rank without Ray s, rayckpt (from its slice)", 1, "rayckpt_est"),
    "dcp_rank_minus": ("load plan N -> N-1, one rank s, DCP (read + plan)", 1, "dcp_est"),
    "rayckpt_rank_half": ("load plan N -> N/2, one rank without Ray s, rayckpt", 1, "rayckpt_est"),
    "dcp_rank_half": ("load plan N -> N/2, one rank s, DCP", 1, "dcp_est"),
    "rayckpt_for_rank_half": ("one rank's plan alone N -> N/2 s, rayckpt `BulkPlan.for_rank` (Ray)", 1, None),
    "dcp_rank_plan_half": ("one rank's plan alone N -> N/2 s, DCP `create_default_local_load_plan`", 1, "dcp_est"),
    "rayckpt_root_half": ("without Ray N -> N/2 s: rank 0 (table, bulk plan, every rank's slice)", 1, "rayckpt_est"),
    "rayckpt_peak_extra": ("coordinator's peak extra GiB, rayckpt", GIB, "rayckpt_est"),
    "dcp_peak_extra": ("coordinator's peak extra GiB, DCP", GIB, "dcp_est"),
}


def markdown(report: dict[str, Any]) -> str:
    """The figures by rank count (CPU seconds of each step's process; "est.": extrapolated, see below), the
    growth exponents, the targets and how each estimate was made."""
    figs = all_figures(report)

    def value(f: dict[str, Any], key: str) -> str:
        label, unit, est = ROWS[key]
        return "" if f[key] is None else cell(f[key] / unit) + (" (est.)" if est and f.get(est) else "")

    rows = [{"figure": label} | {f"{n:,}": value(f, key) for n, f in figs.items()} for key, (label, *_) in ROWS.items()]
    fits = [
        {"series": ROWS[k][0], "k": f.get("exponent"), "points": len(f.get("points", []))}
        for k, f in report.get("fits", {}).items()
    ]
    methods = []
    for n, r in sorted(report["results"].items(), key=lambda kv: int(kv[0])):
        for system in ("rayckpt", "dcp"):
            sampled = _get(r, f"{system}_commit", "sampled")
            if sampled:
                methods.append(
                    f"- N={int(n):,}, {system}'s manifest steps: 1 tensor in {sampled['stride']} of each shape "
                    f"({sampled['tensors']:,} tensors, {sampled['chunks']:,} of {sampled['full_chunks']:,} chunks) "
                    "to fit in memory; bytes, seconds and memory x the chunk ratio."
                )
        if _get(r, "dcp_save_plan", "uncached", "estimated"):
            methods.append(f"- N={int(n):,}, DCP uncached save plan: {r['dcp_save_plan']['uncached']['method']}.")
        for m, t in (_get(r, "dcp_load", "targets") or {}).items():
            if t["whole_job"]["estimated"]:
                methods.append(f"- N={int(n):,} -> {int(m):,}, DCP whole-job load plan: {t['whole_job']['method']}.")
    title = "Planning at scale: thousands of ranks, metadata only"
    return document(title, report, table(rows), table(fits) if fits else None, methods)
