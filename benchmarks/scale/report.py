"""The scale benchmark's figures: series per rank count, growth exponents, the targets, markdown."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.common.harness import table, target, targets_table

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
    f: dict[str, Any] = {
        "rayckpt_est": _sampled(rc, rl),
        "dcp_est": _sampled(dc, dl),
        "rayckpt_bytes": _scaled(rc, "metadata_bytes"),
        "dcp_bytes": _scaled(dc, "metadata_bytes"),
        "rayckpt_chunks": _scaled(rc, "chunks"),
        "dcp_chunks": _scaled(dc, "chunks"),
        "rayckpt_create": _scaled(rc, "create_manifest", "cpu_s"),
        "rayckpt_write": _scaled(rc, "commit", "cpu_s"),
        "dcp_write": _scaled(dc, "write", "cpu_s"),
        "rayckpt_read": _scaled(rl, "read", "cpu_s"),
        "dcp_read": _scaled(dl, "read", "cpu_s"),
        "rayckpt_save_plan": _get(rs, "save_plan", "cpu_s"),
        "rayckpt_save_plan_cached": _get(rs, "cached_save_plan", "cpu_s"),
        "dcp_save_plan": _get(ds, "uncached", "cpu_s"),
        "dcp_save_plan_est": bool(_get(ds, "uncached", "estimated")),
        "dcp_save_plan_cached": _get(ds, "cached", "cpu_s"),
    }
    for tag, m in (("half", half), ("minus", minus)):
        table = _scaled(rl, "chunk_table", "cpu_s")
        f[f"rayckpt_job_{tag}"] = _sum(table, _scaled(rl, "targets", m, "bulk_plan", "cpu_s"))
        # One rank without Ray: its plan from the slice rank 0 scattered (it reads no manifest).
        f[f"rayckpt_rank_{tag}"] = _scaled(rl, "targets", m, "from_slice", "cpu_s")
        f[f"rayckpt_rank_self_{tag}"] = _sum(f["rayckpt_read"], _scaled(rl, "targets", m, "rank_plan", "cpu_s"))
        f[f"rayckpt_root_{tag}"] = _sum(f[f"rayckpt_job_{tag}"], _scaled(rl, "targets", m, "slices", "cpu_s"))
        f[f"dcp_job_{tag}"] = _scaled(dl, "targets", m, "whole_job", "cpu_s")
        f[f"dcp_job_{tag}_est"] = bool(_get(dl, "targets", m, "whole_job", "estimated")) or f["dcp_est"]
        f[f"dcp_rank_{tag}"] = _sum(f["dcp_read"], _scaled(dl, "targets", m, "rank_plan", "cpu_s"))
    mems = [_scaled(rc, "create_manifest", "extra_rss"), _scaled(rc, "commit", "extra_rss")]
    mems += [
        _scaled(rl, "read", "extra_rss"),
        _scaled(rl, "chunk_table", "extra_rss"),
        _get(rs, "save_plan", "extra_rss"),
    ]
    mems += [_scaled(rl, "targets", m, "bulk_plan", "extra_rss") for m in (half, minus)]
    f["rayckpt_peak_extra"] = max((m for m in mems if m is not None), default=None)
    dmems = [_scaled(dc, "write", "extra_rss"), _scaled(dl, "read", "extra_rss"), _get(ds, "uncached", "extra_rss")]
    f["dcp_peak_extra"] = max((m for m in dmems if m is not None), default=None)
    return f


#: Fitted series: name -> (figure, label).
SERIES = {
    "manifest_bytes_rayckpt": ("rayckpt_bytes", "manifest bytes, rayckpt"),
    "manifest_bytes_dcp": ("dcp_bytes", "manifest bytes, DCP .metadata"),
    "read_rayckpt": ("rayckpt_read", "read + parse, rayckpt"),
    "read_dcp": ("dcp_read", "read + parse, DCP"),
    "save_plan_rayckpt": ("rayckpt_save_plan", "global save plan, rayckpt"),
    "save_plan_dcp": ("dcp_save_plan", "global save plan, DCP uncached"),
    "load_job_rayckpt": ("rayckpt_job_half", "load plan N -> N/2, whole job, rayckpt"),
    "load_job_dcp": ("dcp_job_half", "load plan N -> N/2, whole job, DCP"),
    "load_rank_rayckpt": ("rayckpt_rank_half", "load plan N -> N/2, one rank, rayckpt"),
    "load_rank_dcp": ("dcp_rank_half", "load plan N -> N/2, one rank, DCP"),
}


def all_figures(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(n): figures(r, int(n)) for n, r in sorted(report["results"].items(), key=lambda kv: int(kv[0]))}


def series(report: dict[str, Any]) -> dict[str, list[tuple[int, float | None]]]:
    figs = all_figures(report)
    return {name: [(n, f[key]) for n, f in figs.items()] for name, (key, _) in SERIES.items()}


def _row(name: str, measured: float | None, threshold: float, le: bool, how: str) -> dict[str, Any]:
    return target(name, measured, threshold, not le, how)


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, each met / not met (None: not measured)."""
    figs = all_figures(report)
    big = figs.get(TARGET_RANKS, {})
    ratios = [f["rayckpt_bytes"] / f["dcp_bytes"] for f in figs.values() if f["rayckpt_bytes"] and f["dcp_bytes"]]
    speedups = [f["dcp_read"] / f["rayckpt_read"] for f in figs.values() if f["rayckpt_read"] and f["dcp_read"]]
    fits = report.get("fits", {})
    rows = [
        _row("manifest / DCP .metadata, every N", max(ratios, default=None), 0.5, True, "largest ratio over N"),
        _row("read + parse speed-up over DCP unpickle", min(speedups, default=None), 5.0, False, "smallest over N"),
        _row("global save plan at 4,096 ranks (s)", big.get("rayckpt_save_plan"), 2.0, True, "CPU s"),
    ]
    cached = big.get("dcp_save_plan_cached")
    ours = big.get("rayckpt_save_plan_cached")
    rows.append(
        _row(
            "cached save plan / DCP cached at 4,096",
            ours / cached if ours is not None and cached else None,
            1.0,
            True,
            "ratio of the second save's plan, both cached",
        )
    )
    rows += [
        _row("load plan 4,096 -> 2,048, whole job (s)", big.get("rayckpt_job_half"), 1.0, True, "table + bulk plans"),
        _row(
            "load plan 4,096 -> 2,048, one rank without Ray (s)",
            big.get("rayckpt_rank_half"),
            0.1,
            True,
            "its plan from the slice rank 0 scattered (it reads no manifest)",
        ),
        _row(
            "coordinator peak extra memory at 4,096 (GiB)",
            big["rayckpt_peak_extra"] / GIB if big.get("rayckpt_peak_extra") else None,
            2.0,
            True,
            "largest step: create/commit, read, table, bulk plan, save plan",
        ),
    ]
    for name in ("manifest_bytes_rayckpt", "save_plan_rayckpt", "load_job_rayckpt", "load_rank_rayckpt"):
        rows.append(
            _row(
                f"growth exponent: {SERIES[name][1]}",
                fits.get(name, {}).get("exponent"),
                1.1,
                True,
                "log-log least squares over N",
            )
        )
    return rows


def _s(v: float | None, est: bool = False) -> str:
    if v is None:
        return "-"
    if 0 < v < 0.001:
        return f"{v:.1e}" + (" (est.)" if est else "")
    text = f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    return text + (" (est.)" if est else "")


def _n(v: float | None, est: bool = False) -> str:
    return "-" if v is None else f"{v:,.0f}" + (" (est.)" if est else "")


def _mb(v: float | None, est: bool = False) -> str:
    return "-" if v is None else f"{v / 1e6:,.1f}" + (" (est.)" if est else "")


def _x(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def markdown(report: dict[str, Any]) -> str:
    c, mach = report["config"], report["machine"]
    figs = all_figures(report)
    lines = [
        f"`{report['command']}` on {report['date']}: {mach.get('nproc')} CPUs, Python {mach.get('python')}, "
        f"torch {mach.get('torch')}; {c['tensors']} float32 tensors (GPT {c['model']}, params + AdamW states), "
        f"dim-0 sharded; rayckpt block size {c['block_size']}. CPU seconds of the step's process; "
        '"est.": extrapolated (method below). One rank: read + parse + the plan of rank M/2 of M.',
        "",
    ]
    rows = []
    for n, f in figs.items():
        re, de = f["rayckpt_est"], f["dcp_est"]
        rows.append(
            [
                f"{n:,}",
                f"{_n(f['rayckpt_chunks'], re)} / {_n(f['dcp_chunks'], de)}",
                f"{_mb(f['rayckpt_bytes'], re)} / {_mb(f['dcp_bytes'], de)} ({_x(f['rayckpt_bytes'], f['dcp_bytes'])})",
                f"{_s(f['rayckpt_create'], re)} + {_s(f['rayckpt_write'], re)} / {_s(f['dcp_write'], de)}",
                f"{_s(f['rayckpt_read'], re)} / {_s(f['dcp_read'], de)} ({_x(f['dcp_read'], f['rayckpt_read'])})",
            ]
        )
    header = ["ranks", "chunks rayckpt / DCP", "metadata MB rayckpt / DCP (ratio)"]
    header += ["create + write s rayckpt / DCP dump", "read + parse s rayckpt / DCP (DCP / rayckpt)"]
    lines += table(header, rows, right=5) + [""]
    rows = []
    for n, f in figs.items():
        re, de = f["rayckpt_est"], f["dcp_est"]
        job = [
            f"{_s(f[f'rayckpt_job_{t}'], re)} / {_s(f[f'dcp_job_{t}'], f[f'dcp_job_{t}_est'])}"
            for t in ("minus", "half")
        ]
        rank = [f"{_s(f[f'rayckpt_rank_{t}'], re)} / {_s(f[f'dcp_rank_{t}'], de)}" for t in ("minus", "half")]
        pk = " / ".join(
            _s(None if f[k] is None else f[k] / GIB, e) for k, e in (("rayckpt_peak_extra", re), ("dcp_peak_extra", de))
        )
        plan = f"{_s(f['rayckpt_save_plan'])} / {_s(f['dcp_save_plan'], f['dcp_save_plan_est'])}; "
        rows.append(
            [
                f"{n:,}",
                plan + f"{_s(f.get('rayckpt_save_plan_cached'))} / {_s(f['dcp_save_plan_cached'])}",
                *job,
                *rank,
                pk,
            ]
        )
    header = ["ranks", "global save plan s: rayckpt / DCP uncached; cached: rayckpt / DCP"]
    header += ["load plan, whole job s, N -> N-1: rayckpt / DCP", "N -> N/2"]
    header += ["load plan, one rank without Ray s, N -> N-1: rayckpt / DCP", "N -> N/2", "peak extra GiB rayckpt / DCP"]
    lines += table(header, rows, right=7)
    lines += [
        "",
        "One rank's plan alone (no read), N -> N/2: rayckpt `create_load_plan` / `BulkPlan.for_rank` (Ray) / DCP "
        "`create_default_local_load_plan`, CPU s: "
        + "; ".join(
            f"{n:,}: {_s(_scaled(r.get('rayckpt_load', {}), 'targets', max(1, n // 2), 'rank_plan', 'cpu_s'))} / "
            f"{_s(_get(r, 'rayckpt_load', 'targets', max(1, n // 2), 'for_rank', 'cpu_s'))} / "
            f"{_s(_scaled(r.get('dcp_load', {}), 'targets', max(1, n // 2), 'rank_plan', 'cpu_s'))}"
            for n, r in ((int(k), v) for k, v in sorted(report["results"].items(), key=lambda kv: int(kv[0])))
        )
        + ".",
        "",
        "Without Ray, N -> N/2, CPU s: rank 0 (table + bulk plan + every rank's slice; read not included) / "
        "each rank planning from the manifest itself (read + `create_load_plan`, the fallback for other layouts): "
        + "; ".join(
            f"{n:,}: {_s(f['rayckpt_root_half'], f['rayckpt_est'])} / "
            f"{_s(f['rayckpt_rank_self_half'], f['rayckpt_est'])}"
            for n, f in all_figures(report).items()
        )
        + ".",
    ]
    lines += ["", "Growth exponents (value ~ N^k, fitted over the rank counts measured):", ""]
    fits = report.get("fits", {}).items()
    rows = [
        [SERIES[k][1], "-" if f.get("exponent") is None else f"{f['exponent']:.2f}", len(f.get("points", []))]
        for k, f in fits
    ]
    lines += table(["series", "k", "points"], rows, right=2) + ["", "Targets:", ""]
    lines += targets_table(report.get("targets", []))
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
        ds = r.get("dcp_save_plan", {})
        if _get(ds, "uncached", "estimated"):
            methods.append(f"- N={int(n):,}, DCP uncached save plan: {ds['uncached']['method']}.")
        for m, t in (_get(r, "dcp_load", "targets") or {}).items():
            if t["whole_job"]["estimated"]:
                methods.append(f"- N={int(n):,} -> {int(m):,}, DCP whole-job load plan: {t['whole_job']['method']}.")
    return "\n".join(lines + ([""] + methods if methods else [])) + "\n"
