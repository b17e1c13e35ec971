"""The measuring harness every benchmark uses: timing, memory, CPU and load sampling, statistics,
targets as data, the one table renderer and the result files."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
SAMPLE_INTERVAL_S = 0.005

_MEM_FIELDS = {b"VmRSS:": "rss", b"RssAnon:": "anon", b"RssShmem:": "shmem"}


def read_mem(fd: int) -> dict[str, int] | None:
    """RSS, its private (anon) part and anon + shared memory, in bytes, from an open /proc/<pid>/status."""
    try:
        data = os.pread(fd, 8192, 0)
    except OSError:
        return None
    found = {}
    for line in data.split(b"\n"):
        parts = line.split()
        if parts and parts[0] in _MEM_FIELDS:
            found[_MEM_FIELDS[parts[0]]] = int(parts[1]) * 1024
    if "rss" not in found:
        return None
    anon = found.get("anon", 0)
    return {"rss": found["rss"], "anon": anon, "anon_shmem": anon + found.get("shmem", 0)}


class MemSampler:
    """Peak memory of some processes (this one and e.g. a Ray actor) over a window, sampled in a thread
    (``interval`` 0: only the samples at start and stop)."""

    def __init__(self, pids: dict[str, int], interval: float = SAMPLE_INTERVAL_S) -> None:
        self.pids = pids
        self.interval = interval
        self._fds: dict[str, int] = {}
        self._base: dict[str, dict[str, int]] = {}
        self._peak: dict[str, dict[str, int]] = {}
        self._samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        for label, fd in self._fds.items():
            m = read_mem(fd)
            if m is not None:
                self._peak[label] = {k: max(v, m[k]) for k, v in self._peak[label].items()}
        self._samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> MemSampler:
        for label, pid in self.pids.items():
            try:
                fd = os.open(f"/proc/{pid}/status", os.O_RDONLY)
            except OSError:
                continue
            base = read_mem(fd)
            if base is None:
                os.close(fd)
                continue
            self._fds[label], self._base[label], self._peak[label] = fd, base, dict(base)
        if self.interval > 0:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict[str, dict[str, int]]:
        """Per process: its RSS before, and the peak above it of RSS, anon and anon + shared memory."""
        self._sample()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        out = {}
        for label, base in self._base.items():
            extra = {f"extra_{k}": self._peak[label][k] - v for k, v in base.items()}
            out[label] = {"base_rss": base["rss"], **extra, "samples": self._samples}
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        return out


def mem_summary(recs_by_rank: list[list[dict[str, Any]]], label: str, own: list[int]) -> dict[str, Any] | None:
    """Max over repeats of each rank's peak extra memory; ``own``: each rank's own shard bytes."""
    per_rank = []
    for r, recs in enumerate(recs_by_rank):
        mems = [x["mem"][label] for x in recs if label in x.get("mem", {})]
        if mems:
            peak = {k: max(m[k] for m in mems) for k in ("extra_rss", "extra_anon_shmem", "extra_anon")}
            per_rank.append({"rank": r, **peak, "own_bytes": own[r] if r < len(own) else None})
    if not per_rank:
        return None
    over = [p["extra_rss"] - p["own_bytes"] for p in per_rank if p["own_bytes"] is not None]
    worst = {f"max_{k}": max(p[k] for p in per_rank) for k in ("extra_rss", "extra_anon_shmem", "extra_anon")}
    return {"per_rank": per_rank, **worst, "max_extra_rss_over_own": max(over) if over else None}


def proc_io() -> dict[str, int]:
    """This process's I/O counters (read_bytes / write_bytes: what reached the block layer)."""
    try:
        with open("/proc/self/io") as f:
            return {k.strip(): int(v) for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except OSError:
        return {}


def measure(fn: Any, pids: dict[str, int], interval: float = SAMPLE_INTERVAL_S) -> dict[str, Any]:
    """Barrier, sample memory, run ``fn(t0)``, barrier. ``fn`` returns extra figures (stall, commit...)."""
    import torch.distributed as dist

    dist.barrier()
    io0 = proc_io()
    sampler = MemSampler(pids, interval).start()
    t0 = time.perf_counter()
    extra = fn(t0) or {}
    t1 = time.perf_counter()
    mem = sampler.stop()
    dist.barrier()
    t2 = time.perf_counter()
    io = {k: v - io0[k] for k, v in proc_io().items() if k in io0}
    return {"wall": t2 - t0, "own": t1 - t0, "io": io, "mem": mem, **extra}


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(fn: Any, barrier: bool = False, device: str = "cpu") -> tuple[float, Any]:
    """Seconds ``fn()`` took and its result; ``barrier``: between ``dist.barrier()`` calls (the time of the
    slowest rank); ``device`` "cuda": after a CUDA sync on both sides."""

    def settle() -> None:
        if barrier:
            import torch.distributed as dist

            dist.barrier()
        sync(device)

    settle()
    t0 = time.perf_counter()
    out = fn()
    settle()
    return time.perf_counter() - t0, out


def profiled(fn: Callable[[], Any]) -> tuple[dict[str, float], Any]:
    """Run ``fn`` once: its CPU and wall seconds and its peak RSS above the RSS before it; and its result."""
    gc.collect(1)  # the young garbage of what ran before (a full pass over millions of objects takes seconds)
    sampler = MemSampler({"self": os.getpid()}, interval=0.02).start()
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {"cpu_s": cpu, "wall_s": wall, "extra_rss": sampler.stop()["self"]["extra_rss"]}, out


def repeated(fn: Callable[[], Any], times: int = 5) -> tuple[dict[str, Any], Any]:
    """``profiled`` ``times`` times: the run of median CPU seconds, with every run's CPU and wall seconds
    (``summary``s) and its largest peak RSS."""
    runs = sorted((profiled(fn) for _ in range(times)), key=lambda r: r[0]["cpu_s"])
    stats, out = runs[len(runs) // 2]
    cpu, wall = summary([r[0]["cpu_s"] for r in runs]), summary([r[0]["wall_s"] for r in runs])
    return {**stats, "cpu": cpu, "wall": wall, "peak_extra_rss": max(r[0]["extra_rss"] for r in runs)}, out


def rotated(items: list[str] | tuple[str, ...], rep: int) -> list[str]:
    """``items`` rotated by ``rep``: no system always runs first (or right after another) in a repeat."""
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


def grouped(records: list[dict[str, Any]], *keys: str) -> dict[Any, list[dict[str, Any]]]:
    """``records`` by their values of ``keys`` (one key: its value; more: a tuple), in order of first appearance
    (e.g. a step's records from every rank)."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault(r[keys[0]] if len(keys) == 1 else tuple(r[k] for k in keys), []).append(r)
    return out


def summary(values: list[float], nbytes: int | None = None) -> dict[str, Any]:
    med = statistics.median(values)
    out = {"values": values, "median": med, "min": min(values), "max": max(values)}
    if nbytes is not None and med > 0:
        out["GBps_median"] = nbytes / 1e9 / med
    return out


def target(name: str, measured: float | None, threshold: float, higher_is_better: bool, how: str) -> dict:
    """One target as data: what is measured, against which threshold, which way, and whether it is met."""
    met = None
    if measured is not None:
        met = measured >= threshold if higher_is_better else measured <= threshold
    row = {"target": name, "measured": measured, "threshold": threshold, "how": how}
    return row | {"direction": ">=" if higher_is_better else "<=", "met": met}


def machine_info() -> dict[str, Any]:
    """What a report records of the machine and the library versions (the reports add their own fields)."""
    import platform

    import pyarrow
    import ray
    import torch

    import rayckpt

    versions = {m.__name__: m.__version__ for m in (torch, ray, pyarrow, rayckpt)}
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    host = {"nproc": os.cpu_count(), "mem_total_gb": memory, "python": platform.python_version()}
    return host | versions | {"platform": platform.platform()}


def new_report(command: str, argv: list[str] | None, doc: str | None = None, **fields: Any) -> dict[str, Any]:
    """What every report starts with: its command line (``command``: ``benchmarks.<group> [sub-command]``,
    then ``argv``), the date (UTC), the machine and what it measures (``doc``, the benchmark's docstring);
    then ``fields``."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "command": " ".join([".venv/bin/python -m", command, *args]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_info(),
        "about": " ".join(doc.split()) if doc else None,
        **fields,
    }


def import_rayckpt() -> None:
    """Import what ``rayckpt.save`` and ``rayckpt.load`` run, now."""
    import rayckpt

    for name in ("save", "load"):
        getattr(rayckpt, name)


def connect_ray(address: str) -> None:
    """Join the driver's Ray cluster from a rank, quietly, in the benchmarks' namespace."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, namespace="rayckpt-bench")


@contextmanager
def load_sampled(report: dict[str, Any]) -> Iterator[None]:
    """While the block runs, the machine's 1-minute load average every 5 s; then ``report["load_average_1min"]``
    (its summary, and the samples) and the block's seconds as ``total_runtime_s``."""
    samples: list[tuple[float, float]] = []
    before, stop = os.getloadavg()[0], threading.Event()

    def loop() -> None:
        while True:
            samples.append((round(time.time(), 1), round(os.getloadavg()[0], 2)))
            if stop.wait(5.0):
                return

    sampler = threading.Thread(target=loop, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stop.set()
        sampler.join()
    load = {k: v for k, v in summary([x[1] for x in samples]).items() if k != "values"}
    report["load_average_1min"] = {"before_start": before, **load, "samples": samples}
    report["total_runtime_s"] = time.perf_counter() - t0


#: Keys of a report that hold raw samples: written to ``<name>.samples.json``, not to the summary.
RAW_KEYS = ("records", "samples", "repeats_raw")


def write_report(args: Any, name: str, report: dict[str, Any], md: str, echo: bool = True) -> int:
    """The summary as ``<args.out>/<name>.json`` (the raw samples apart, in ``<name>.samples.json``), the
    Markdown ``md`` as ``<args.out>/<name>.md`` (and at ``args.markdown``, where given), ``md`` printed
    (``echo``); 0."""
    missing = [k for k in ("command", "date", "machine") if k not in report]
    if missing:
        raise ValueError(f"a result names its command, date and machine; {name} lacks {', '.join(missing)}")
    os.makedirs(args.out, exist_ok=True)
    raw = {k: report[k] for k in RAW_KEYS if k in report}
    summary_only = {k: v for k, v in report.items() if k not in RAW_KEYS}
    load = report.get("load_average_1min")
    if isinstance(load, dict) and "samples" in load:
        raw["load_samples"] = load["samples"]
        summary_only["load_average_1min"] = {k: v for k, v in load.items() if k != "samples"}
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(summary_only, f, indent=2, default=str)
    if raw:
        with open(os.path.join(args.out, f"{name}.samples.json"), "w") as f:
            json.dump(raw, f, default=str)
    for path in filter(None, (os.path.join(args.out, f"{name}.md"), getattr(args, "markdown", None))):
        with open(path, "w") as f:
            f.write(md)
    if echo:
        print(md)
    return 0


def num(v: float) -> str:
    """A figure to about three significant digits: 0.0123, 0.123, 1.23, 12.3, 1,234 (a whole number: 12)."""
    if v == 0 or not math.isfinite(v) or abs(v) >= 100 or v == int(v):
        return f"{v:,.0f}"
    return f"{v:.{max(0, 2 - math.floor(math.log10(abs(v))))}f}"


def cell(v: Any) -> str:
    """One table cell: nothing for ``None``, yes / no, whole numbers with thousands separators, other numbers
    by ``num``, a ``summary`` as "median (min-max)"."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return num(v)
    if isinstance(v, dict) and "median" in v:
        return f"{num(v['median'])} ({num(v['min'])}-{num(v['max'])})"
    return str(v)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The one table renderer: ``rows`` (dicts; their keys, in order, are the columns) as a Markdown table,
    each value by ``cell``, the columns of numbers right-aligned."""
    header = list(dict.fromkeys(k for row in rows for k in row))

    def numeric(k: str) -> bool:
        return any(isinstance(r.get(k), (int, float, dict)) and not isinstance(r.get(k), bool) for r in rows)

    lines = [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---:" if numeric(k) else "---" for k in header) + " |",
    ]
    return lines + ["| " + " | ".join(cell(row.get(k)) for k in header) + " |" for row in rows]


def targets_table(rows: list[dict[str, Any]]) -> list[str]:
    """The targets as the one "target | measured | goal | met" table every report shows."""
    goal = "{direction} {threshold:g}"
    return table(
        [{"target": t["target"], "measured": t["measured"], "goal": goal.format(**t), "met": t["met"]} for t in rows]
    )


def run_line(report: dict[str, Any]) -> str:
    """Command, date, machine and versions of a run, and its load: the line every result starts with."""
    m = report["machine"]
    versions = ", ".join(f"{k} {m[k]}" for k in ("torch", "ray", "pyarrow", "rayckpt") if k in m)
    line = f"`{report['command']}` on {report['date']}: {m['nproc']} CPUs, {m['mem_total_gb']:.0f} GB RAM"
    line += f"{', ' + m['device'] if m.get('device') not in (None, 'cpu') else ''}; {versions}."
    if "total_runtime_s" in report:
        line += f" Run time {report['total_runtime_s']:.0f} s."
    load = report.get("load_average_1min")
    if isinstance(load, dict) and "median" in load:
        line += f" Load average (1 min): median {load['median']:.2f}, max {load['max']:.2f}."
    return line


def document(title: str, report: dict[str, Any], *parts: str | list[str] | None) -> str:
    """A result's Markdown: ``title``, the run's line, what it measures (``report["about"]``), its settings
    (``report["config"]``), then each of ``parts`` (a paragraph, or a table's lines), then its targets."""
    config = report.get("config") or {}
    settings = "Settings: " + ", ".join(f"{k} {v}" for k, v in config.items() if k not in ("out", "markdown"))
    targets = targets_table(report["targets"]) if report.get("targets") else None
    lines = [f"## {title}", "", run_line(report)]
    for part in (report.get("about"), settings if config else None, *parts, targets):
        if part:
            lines += ["", *([part] if isinstance(part, str) else part)]
    return "\n".join(lines) + "\n"


def mib(n: float | None) -> str:
    return "" if n is None else f"{n / MIB:,.0f}"
