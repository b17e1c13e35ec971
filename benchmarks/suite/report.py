"""The suite's report: the targets, the markdown tables and the chart of the target ratios.

Nothing here measures: it turns the report ``python -m benchmarks.suite`` assembled (a dict, also
written as ``bench_suite.json``) into the target rows of each size (``targets``), the run's
Markdown (``markdown``) and a PNG of the target ratios (matplotlib, or a bare hand-made PNG
without it).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

from benchmarks.common.harness import MIB, fmt, mib, ratio_row
from benchmarks.suite.load import LOAD_LABELS, LOAD_SYSTEMS
from benchmarks.suite.save import SAVE_LABELS, SAVE_SYSTEMS

#: "Bounded buffer" allowed on top of a rank's own shard in the memory target.
MEM_BUFFER_BYTES = 64 * 2**20
#: Planning target: all target ranks' plans in under this many seconds.
PLAN_TARGET_S = 1.0


# ---------------------------------------------------------------------------
# Targets


def targets(size: dict[str, Any], main_reshard: str) -> list[dict[str, Any]]:
    """The target rows of one size: save, reshard load, persist throughput, memory (in that order)."""
    s = size["save"]
    rows = save_targets(s)
    rows += load_targets(size["load"].get(main_reshard) or {}, main_reshard)
    rows += throughput_targets(s)
    rows += memory_targets(size)
    return rows


def save_targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    dcp_save = s["dcp"]["commit_s"]["median"]
    return [
        ratio_row(
            "save stall: rayckpt Ray save_async / DCP save",
            s["rayckpt_ray"]["stall_s"]["median"] / dcp_save,
            0.2,
            False,
            "median SaveHandle.stall_seconds (max over ranks) / median DCP dcp.save time",
        ),
        ratio_row(
            "durable commit: rayckpt Ray save_async / DCP save",
            s["rayckpt_ray"]["commit_s"]["median"] / dcp_save,
            1.0,
            False,
            "median barrier-to-handle.wait() (max over ranks) / median dcp.save",
        ),
        ratio_row(
            "durable commit: rayckpt.save (sync) / DCP save",
            s["rayckpt"]["commit_s"]["median"] / dcp_save,
            1.0,
            False,
            "median rayckpt.save / median dcp.save",
        ),
    ]


def load_targets(ld: dict[str, Any], main_reshard: str) -> list[dict[str, Any]]:
    rows = []
    for suffix, label, how in (
        ("", "", " (page cache evicted)"),
        ("_warm", ", page cache warm", ", checkpoint files read into the page cache first"),
    ):
        if "rayckpt" + suffix in ld and "dcp" + suffix in ld:
            rows.append(
                ratio_row(
                    f"reshard load {main_reshard}{label}: DCP time / rayckpt time",
                    ld["dcp" + suffix]["wall_s"]["median"] / ld["rayckpt" + suffix]["wall_s"]["median"],
                    1.5,
                    True,
                    f"median dcp.load / median rayckpt.load{how}",
                )
            )
    return rows


def throughput_targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    raw_w = s["raw"]["commit_s"]["median"]
    return [
        ratio_row(
            "persist throughput: rayckpt.save (sync) / raw write+fsync",
            raw_w / s["rayckpt"]["commit_s"]["median"],
            0.8,
            True,
            "GB/s of rayckpt.save over GB/s of the raw write + fsync of the same bytes, same ranks",
        ),
        ratio_row(
            "persist throughput: rayckpt Ray (commit - stall) / raw write+fsync",
            raw_w / s["rayckpt_ray"]["persist_s"]["median"],
            0.8,
            True,
            "GB/s of the background part of save_async (commit - stall, max over ranks) over raw",
        ),
    ]


def memory_targets(size: dict[str, Any]) -> list[dict[str, Any]]:
    s = size["save"]
    rows = []
    worst = []
    for label, m in (("save", s["rayckpt"]["mem"]), ("save_async rank", s["rayckpt_ray"]["mem"])):
        if m and m["max_extra_rss_over_own"] is not None:
            worst.append((m["max_extra_rss_over_own"], label))
    for reshard, entry in size["load"].items():
        m = entry.get("rayckpt", {}).get("mem")
        if m and m["max_extra_rss_over_own"] is not None:
            worst.append((m["max_extra_rss_over_own"], f"load {reshard}"))
    if worst:
        over, where = max(worst)
        rows.append(
            ratio_row(
                f"memory: rayckpt rank peak extra RSS - own shard (worst: {where}), MiB",
                over / MIB,
                MEM_BUFFER_BYTES / MIB,
                False,
                "max over ranks, repeats and rayckpt operations of (peak RSS - RSS before) - the rank's own shard "
                "bytes, against a bounded buffer of 64 MiB",
            )
        )
    w = s["rayckpt_ray"].get("writer_mem")
    if w:
        rows.append(
            ratio_row(
                "memory: ShardWriter actor peak extra private (anon) memory, MiB",
                w["max_extra_anon"] / MIB,
                MEM_BUFFER_BYTES / MIB,
                False,
                "the node's writer maps the ranks' staged shards (object store shared memory, counted at the "
                "ranks); its private memory during the save against 64 MiB",
            )
        )
    return rows


# ---------------------------------------------------------------------------
# Markdown


def markdown(report: dict[str, Any]) -> str:
    """The run's report: its header, then per size the save, load and target tables, the method, planning."""
    lines = header_lines(report)
    for key, size in report["sizes"].items():
        lines += size_lines(key, size)
    lines += method_lines(report)
    plan = report.get("plan")
    if plan:
        lines += plan_lines(plan)
    return "\n".join(lines) + "\n"


def header_lines(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    la = report["load_average_1min"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{report['command']}` on {report['date']}: {m['nproc']} CPUs, "
        f"{m['mem_total_gb']:.0f} GB RAM, torch {m['torch']}, ray {m['ray']}, pyarrow {m['pyarrow']}, "
        f"rayckpt {m['rayckpt']}. 1-minute load average: {la['before_start']:.2f} before the start; during the "
        f"run (its own 4 ranks and Ray included) min {la['min']:.2f}, median {la['median']:.2f}, max "
        f"{la['max']:.2f}; CPU used by processes outside the benchmark (kernel writeback included): mean "
        f"{la['other_processes_cpu_cores']['mean']:.2f}, max {la['other_processes_cpu_cores']['max']:.2f} "
        f"cores of {m['nproc']}. Total run time {report['total_runtime_s']:.0f} s.",
        "",
        "Numbers on a 2-core machine are noisy (+-25% run to run): read the ratios between systems measured in "
        "the same run; seconds are medians over repeats with (min-max); GB = 1e9 bytes.",
    ]
    chart = report.get("chart")
    if chart:
        lines += ["", f"Chart of the target ratios: `{chart['shown_as']}` ({chart['renderer']})."]
    return lines


def size_lines(key: str, size: dict[str, Any]) -> list[str]:
    """One size's section: the save table, the raw read and gather line, the load and target tables."""
    s = size["save"]
    n0 = size["save_ranks"]
    own = max(size["own_bytes_per_save_rank"])
    lines = [
        "",
        f"## {size['state_bytes'] / 1e9:.3f} GB state ({key}: fp32 params + AdamW exp_avg + exp_avg_sq, "
        f"{len(size['layer_shapes_rows_cols'])} FSDP2 Linear layers)",
        "",
        f"### Save, {n0} ranks (largest own shard {mib(own)} MiB)",
        "",
    ]
    lines += save_table(size)
    g = s["torch_save_gather"]
    lines += [
        "",
        f"Raw disk cold read of the same bytes ({n0} procs): {fmt(s['raw_read']['wall_s'])} s, "
        f"{s['raw_read']['wall_s'].get('GBps_median', 0):.2f} GB/s. torch.save's full-state gather to rank 0 "
        f"(once, not in the times above): {g['wall_s']:.2f} s, rank 0 +{mib(g['rank0_extra_rss'])} MiB RSS.",
        "",
        "### Load (page cache evicted before each load; 'page cache warm' rows: files read into it first)",
        "",
    ]
    lines += load_table(size)
    lines += ["", "### Targets", ""]
    lines += targets_table(size["targets"])
    return lines


def save_table(size: dict[str, Any]) -> list[str]:
    s = size["save"]
    lines = [
        "| system | stall s (train loop blocked) | durable commit s | commit GB/s | peak extra RSS per rank, "
        "MiB (max) | of which anon+shm MiB | on-disk bytes (files) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for system in SAVE_SYSTEMS:
        e = s[system]
        disk = size["on_disk"].get(system, {})
        memo = e["mem"] or {}
        lines.append(
            f"| {SAVE_LABELS[system]} | {fmt(e['stall_s'])} | {fmt(e['commit_s'])} | "
            f"{e['commit_s'].get('GBps_median', 0):.2f} | {mib(memo.get('max_extra_rss'))} | "
            f"{mib(memo.get('max_extra_anon_shmem'))} | "
            f"{disk.get('bytes', 0):,} ({disk.get('files', 0)}) |"
        )
    w = s["rayckpt_ray"].get("writer_mem")
    if w:
        lines.append(
            f"| ShardWriter actor (node's, during save_async) | | | | {mib(w['max_extra_rss'])} | "
            f"{mib(w['max_extra_anon_shmem'])} | |"
        )
    return lines


def load_table(size: dict[str, Any]) -> list[str]:
    lines = [
        "| reshard | system | load s | GB/s | bytes read / needed (read amp.) | peak extra RSS per rank, MiB "
        "(max) | of which anon+shm MiB | own shard MiB (max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, ld in size["load"].items():
        for system in LOAD_SYSTEMS:
            e = ld.get(system)
            if not e:
                continue
            amp = e.get("read_amplification")
            read = sum(e.get("bytes_read_per_rank") or [0])
            need = sum(e.get("bytes_needed_per_rank") or [0])
            amp_s = "" if amp is None else f"{mib(read)} / {mib(need)} MiB ({amp:.3f})"
            if system == "torch_load":
                amp_s = f"whole file: {amp_s}"
            memo = e["mem"] or {}
            lines.append(
                f"| {name} | {LOAD_LABELS[system]} | {fmt(e['wall_s'])} | "
                f"{e['wall_s'].get('GBps_median', 0):.2f} | {amp_s} | {mib(memo.get('max_extra_rss'))} | "
                f"{mib(memo.get('max_extra_anon_shmem'))} | {mib(max(ld['own_bytes_per_rank']))} |"
            )
        for suffix, label in (("", ""), ("_warm", ", page cache warm")):
            if "rayckpt" + suffix in ld and "dcp" + suffix in ld:
                ratio = ld["dcp" + suffix]["wall_s"]["median"] / ld["rayckpt" + suffix]["wall_s"]["median"]
                lines.append(f"| {name} | DCP / rayckpt time{label} (>1: rayckpt faster) | {ratio:.2f} | | | | | |")
    return lines


def targets_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | measured | target | met |", "| --- | --- | --- | --- |"]
    for t in rows:
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "**not met**")
        val = "n/a" if t["measured"] is None else f"{t['measured']:.3f}"
        lines.append(f"| {t['target']} | {val} | {t['direction']} {t['threshold']:g} | {met} |")
    return lines


def method_lines(report: dict[str, Any]) -> list[str]:
    """How everything was measured (prose; the sampling interval comes from the run's config)."""
    return [
        "",
        "## Method",
        "",
        "- One command runs every system on the same machine; each repeat runs every system once, in an order "
        "that rotates from repeat to repeat. Times are barrier to barrier (``dist.barrier()``) on gloo ranks "
        "spawned with ``rayckpt.testing.multiproc.run_ranks``; a figure is the max over ranks, then median (min-max) "
        "over repeats.",
        "- Stall = time the calling rank is blocked: the whole call for synchronous saves; "
        "``SaveHandle.stall_seconds`` for rayckpt's Ray ``save_async`` (plan + one copy into shared memory: the "
        "rank's staging buffer in /dev/shm, made before the repeats with ``prepare_staging`` as "
        "``Checkpointer.restore`` does, and reused by every save; it holds the rank's share between saves); "
        "until ``dcp.async_save`` returns for DCP (its staging copy). Durable commit = from the barrier before "
        "the call until the checkpoint is committed: ``handle.wait()`` / ``future.result()`` return.",
        "- The Ray path: the driver runs ``ray.init(num_cpus=8)``; every rank connects with "
        "``ray.init(address=...)``; the node's ShardWriter actor writes the staged shards and the "
        "MetadataActor commits. Actors and code paths are warmed with a tiny save first.",
        "- torch.save: the full state dict (params + optimizer) is gathered on rank 0 once per size "
        "(``get_state_dict(full_state_dict=True, cpu_offload=True)``, reported apart) and the timed part is "
        "``torch.save`` + fsync on rank 0. torch.load: ``torch.load(weights_only=True)`` + ``set_state_dict`` "
        "into the 1-rank model (the 4->1 row).",
        "- Raw disk: each save rank writes its 1/N of the state bytes (8 MiB blocks, one file per rank) then "
        "fsyncs; the read is of the same files after evicting them from the page cache.",
        "- Loads: before every load the checkpoint files are fsynced and dropped from the page cache "
        "(``posix_fadvise(DONTNEED)``). The first load of each system into a zeroed model is checked bit-exact "
        "against checksums of the saved state. 2-rank checkpoints (for 2->4) are written by the 4->2 ranks "
        "after their loads. The 'page cache warm' rows load the same checkpoints after rank 0 has read their "
        "files once (a restart on the node that saved): they time the loader's own work, not the disk.",
        "- Read amplification: rayckpt = sum of ``LoadInfo.bytes_read`` / sum of ``bytes_needed``; DCP = bytes "
        "its ranks read through ``read()`` (``rchar`` in /proc/self/io) / the same bytes needed; torch.load "
        "reads the whole file on one process.",
        f"- Memory: a thread in each rank samples /proc/self/status (VmRSS, RssAnon, RssShmem) every "
        f"{report['config']['memory_sample_interval_s'] * 1000:g} ms during "
        "the operation; the figure is the peak minus the value just before, max over repeats and ranks. "
        "'anon+shm' leaves out file-backed pages (memory-mapped checkpoint files, which are page cache). For "
        "the Ray save, rank 0 also samples the ShardWriter actor's process. Memory a process freed earlier but "
        "still holds (allocator caches) is reused without raising its RSS, so the figures are lower bounds of "
        "what an operation allocates. The memory target allows a rank "
        f"its own shard bytes plus a bounded buffer of {MEM_BUFFER_BYTES // MIB} MiB.",
        "- Persist throughput: state bytes over rayckpt's save time against the same bytes over the raw "
        "write + fsync time of the same number of processes.",
    ]


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """The planning benchmark's own table (without its title) and the planning target."""
    bulk = plan["results"]["bulk_plan"]["seconds"]["median"]
    met = "met" if bulk < PLAN_TARGET_S else "**not met**"
    table = plan["markdown"].split("\n", 1)[1].lstrip("\n")  # without its own title
    lines = ["", "## Planning at scale (no I/O)", "", table.rstrip(), ""]
    lines += [
        "| target | measured | target | met |",
        "| --- | --- | --- | --- |",
        f"| planning {plan['config']['saved_ranks']} saved -> {plan['config']['target_ranks']} target ranks "
        f"x {plan['config']['tensors']} tensors, s (create_dim0_plans, all ranks) | {bulk:.3f} | "
        f"< {PLAN_TARGET_S:g} | {met} |",
    ]
    return lines


# ---------------------------------------------------------------------------
# Chart


def chart_rows(report: dict[str, Any]) -> list[tuple[str, str, float, float, bool]]:
    """(target, size, measured, threshold, higher_is_better) for every ratio target."""
    rows = []
    for key, size in report["sizes"].items():
        for t in size["targets"]:
            if t["measured"] is None or "MiB" in t["target"]:
                continue
            rows.append((t["target"], key, t["measured"], t["threshold"], t["direction"] == ">="))
    return rows


def write_chart(report: dict[str, Any], path: str) -> str:
    """The target ratios as bars, one panel per target; returns which renderer drew it."""
    rows = chart_rows(report)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        write_png_bars(rows, path)
        return "hand-made (matplotlib not installed)"
    names = list(dict.fromkeys(r[0] for r in rows))
    sizes = list(dict.fromkeys(r[1] for r in rows))
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    for ax, name in zip(axes.flat, names):
        mine = [r for r in rows if r[0] == name]
        xs = list(range(len(mine)))
        colors = ["#2a9d4a" if (r[2] >= r[3] if r[4] else r[2] <= r[3]) else "#d1495b" for r in mine]
        ax.bar(xs, [r[2] for r in mine], color=colors)
        ax.axhline(mine[0][3], color="black", linestyle="--", linewidth=1)
        ax.set_xticks(xs, [r[1] for r in mine])
        for x, r in zip(xs, mine):
            ax.text(x, r[2], f"{r[2]:.2f}", ha="center", va="bottom", fontsize=8)
        wrapped = name.replace(": ", ":\n", 1).replace(" / ", "\n/ ")
        ax.set_title(f"{wrapped}\n(target {'>=' if mine[0][4] else '<='} {mine[0][3]:g})", fontsize=8)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"rayckpt targets, sizes {', '.join(sizes)} (green: met, red: not met)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def write_png_bars(rows: list[tuple[str, str, float, float, bool]], path: str) -> None:
    """A bare bar chart (no text): one bar per (target, size), its height measured/threshold, a black
    line at 1.0; green where the target is met, red where not. The markdown names the bars in order."""
    width, height, margin = 40 + 36 * max(len(rows), 1), 240, 20
    img = [[(255, 255, 255)] * width for _ in range(height)]
    top = max([r[2] / r[3] for r in rows] + [1.0]) * 1.1
    plot_h = height - 2 * margin

    def y_of(v: float) -> int:
        return height - margin - int(plot_h * v / top)

    for i, (_name, _size, val, thr, higher) in enumerate(rows):
        met = val >= thr if higher else val <= thr
        color = (42, 157, 74) if met else (209, 73, 91)
        x0 = margin + 36 * i + 6
        for y in range(y_of(val / thr), height - margin):
            for x in range(x0, x0 + 24):
                img[y][x] = color
    for x in range(margin, width - margin):
        img[y_of(1.0)][x] = (0, 0, 0)
        img[height - margin][x] = (90, 90, 90)
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)
