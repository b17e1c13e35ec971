"""The measuring harness every benchmark uses: timing, sampling, statistics, targets and results."""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
SAMPLE_INTERVAL_S = 0.005


_MEM_FIELDS = {b"VmRSS:": "rss", b"RssAnon:": "anon", b"RssFile:": "file", b"RssShmem:": "shmem"}


def read_mem(fd: int) -> dict[str, int] | None:
    """VmRSS / RssAnon / RssFile / RssShmem in bytes from an open /proc/<pid>/status."""
    try:
        data = os.pread(fd, 8192, 0)
    except OSError:
        return None
    out = {}
    for line in data.split(b"\n"):
        parts = line.split()
        if parts and parts[0] in _MEM_FIELDS:
            out[_MEM_FIELDS[parts[0]]] = int(parts[1]) * 1024
    return out if "rss" in out else None


class MemSampler:
    """Peak RSS of some processes (this one and e.g. a Ray actor) over a window, sampled in a thread."""

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
            if m is None:
                continue
            peak = self._peak[label]
            peak["rss"] = max(peak["rss"], m["rss"])
            peak["anon_shmem"] = max(peak["anon_shmem"], m.get("anon", 0) + m.get("shmem", 0))
            for k in ("anon", "file", "shmem"):
                peak[k] = max(peak[k], m.get(k, 0))
        self._samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()
        # interval 0: no thread (start() does not start one); only the before/after samples.

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
            self._fds[label] = fd
            self._base[label] = base
            self._peak[label] = {
                "rss": base["rss"],
                "anon_shmem": base.get("anon", 0) + base.get("shmem", 0),
                **{k: base.get(k, 0) for k in ("anon", "file", "shmem")},
            }
        if self.interval > 0:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict[str, dict[str, int]]:
        self._sample()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        out = {}
        for label, base in self._base.items():
            peak = self._peak[label]
            out[label] = {
                "base_rss": base["rss"],
                "extra_rss": peak["rss"] - base["rss"],
                "extra_anon_shmem": peak["anon_shmem"] - base.get("anon", 0) - base.get("shmem", 0),
                **{f"extra_{k}": peak[k] - base.get(k, 0) for k in ("anon", "file", "shmem")},
                "samples": self._samples,
            }
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        return out


def mem_summary(recs_by_rank: list[list[dict[str, Any]]], label: str, own: list[int]) -> dict[str, Any] | None:
    """Max over repeats of each rank's peak extra memory; ``own``: each rank's own shard bytes."""
    per_rank = []
    for r, recs in enumerate(recs_by_rank):
        mems = [x["mem"][label] for x in recs if label in x.get("mem", {})]
        if not mems:
            continue
        per_rank.append(
            {
                "rank": r,
                "extra_rss": max(m["extra_rss"] for m in mems),
                "extra_anon_shmem": max(m["extra_anon_shmem"] for m in mems),
                "extra_anon": max(m["extra_anon"] for m in mems),
                "extra_file": max(m["extra_file"] for m in mems),
                "extra_shmem": max(m["extra_shmem"] for m in mems),
                "base_rss": mems[0]["base_rss"],
                "own_bytes": own[r] if r < len(own) else None,
                "samples_min": min(m["samples"] for m in mems),
            }
        )
    if not per_rank:
        return None
    over = [p["extra_rss"] - p["own_bytes"] for p in per_rank if p["own_bytes"] is not None]
    return {
        "per_rank": per_rank,
        "max_extra_rss": max(p["extra_rss"] for p in per_rank),
        "max_extra_anon_shmem": max(p["extra_anon_shmem"] for p in per_rank),
        "max_extra_anon": max(p["extra_anon"] for p in per_rank),
        "max_own_bytes": max(p["own_bytes"] or 0 for p in per_rank),
        "max_extra_rss_over_own": max(over) if over else None,
    }


def proc_io() -> dict[str, int]:
    """This process's I/O counters (read_bytes / write_bytes: what reached the block layer)."""
    try:
        with open("/proc/self/io") as f:
            return {k.strip(): int(v) for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except OSError:
        return {}


def io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("read_bytes", "write_bytes", "rchar", "wchar") if k in before}


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
    return {"wall": t2 - t0, "own": t1 - t0, "io": io_delta(io0, proc_io()), "mem": mem, **extra}


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


def sampled(fn: Any, repeats: int) -> tuple[dict[str, Any], Any]:
    """``repeats`` runs of ``fn``: the ``summary`` of their seconds, and the last run's result."""
    values, out = [], None
    for _ in range(repeats):
        out = None  # the last result is freed before the next run
        seconds, out = timed(fn)
        values.append(seconds)
    return summary(values), out


def memcpy_anchor() -> dict[str, float]:
    """Single-thread memory copy speed (64 MiB, 4 times): the anchor for copy-bound phases."""
    import torch

    a = torch.empty(64 * 2**20 // 4)
    a.normal_()
    b = torch.empty_like(a)
    t0 = time.perf_counter()
    for _ in range(4):
        b.copy_(a)
    return {
        "memcpy_GBps_1thread": 4 * a.numel() * 4 / 1e9 / (time.perf_counter() - t0),
        "torch_threads": torch.get_num_threads(),
    }


def rotated(items: list[str] | tuple[str, ...], rep: int) -> list[str]:
    """``items`` rotated by ``rep``: no system always runs first (or right after another) in a repeat."""
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


def machine_info() -> dict[str, Any]:
    """What a report records of the machine and the library versions (the reports add their own fields)."""
    import platform

    import pyarrow
    import ray
    import torch

    import rayckpt

    return {
        "nproc": os.cpu_count(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "pyarrow": pyarrow.__version__,
        "rayckpt": rayckpt.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mem_total_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
    }


def new_report(command: str, argv: list[str] | None, **fields: Any) -> dict[str, Any]:
    """What every report starts with: its command line (``command``: ``benchmarks.<group> [sub-command]``,
    then ``argv``), the date (UTC) and the machine; then ``fields``."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "command": " ".join([".venv/bin/python -m", command, *args]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_info(),
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
    return {
        "target": name,
        "measured": measured,
        "threshold": threshold,
        "direction": ">=" if higher_is_better else "<=",
        "met": met,
        "how": how,
    }


def busy_jiffies() -> int:
    """CPU time (clock ticks) the whole machine spent busy: /proc/stat minus idle and iowait."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:9]]
    return sum(vals) - vals[3] - vals[4]


def tree_jiffies(root: int) -> int:
    """CPU ticks of ``root`` and all its descendants (utime + stime + reaped children's)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(rest[1]), []).append(int(name))
        ticks[int(name)] = sum(int(x) for x in rest[11:15])
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def load_avg_thread(samples: list[tuple[float, float, float | None]], stop: threading.Event) -> threading.Thread:
    """Every 5 s: the 1-minute load average, and the CPU cores used by processes outside this benchmark's
    process tree (ranks, Ray and its actors are inside it; kernel threads, e.g. writeback, are outside)."""
    hz = os.sysconf("SC_CLK_TCK")

    def loop() -> None:
        prev = (time.monotonic(), busy_jiffies(), tree_jiffies(os.getpid()))
        while True:
            now = (time.monotonic(), busy_jiffies(), tree_jiffies(os.getpid()))
            dt = now[0] - prev[0]
            others = (now[1] - prev[1] - (now[2] - prev[2])) / hz / dt if dt > 0.5 else None
            if now[2] < prev[2] or (others is not None and not 0 <= others <= (os.cpu_count() or 1) + 0.5):
                others = None  # a process left the tree unaccounted (killed, reparented): no figure
            samples.append((time.time(), os.getloadavg()[0], others))
            prev = now
            if stop.wait(5.0):
                return

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def load_average(before: float, samples: list[tuple[float, float, float | None]]) -> dict[str, Any]:
    """The machine's load during the run, and the CPU that processes outside the benchmark took."""
    loads = [x[1] for x in samples]
    others = [x[2] for x in samples if x[2] is not None] or [0.0]
    return {
        "before_start": before,
        "min": min(loads),
        "median": statistics.median(loads),
        "max": max(loads),
        "other_processes_cpu_cores": {
            "mean": statistics.fmean(others),
            "max": max(others),
            "note": "CPU used outside this benchmark's process tree per 5 s window (incl. kernel writeback)",
        },
        "samples_time_load1_othercores": [
            (round(t, 1), round(v, 2), None if o is None else round(o, 2)) for t, v, o in samples
        ],
    }


@contextmanager
def load_sampled(report: dict[str, Any]) -> Iterator[None]:
    """Sample the machine's load while the block runs (``load_avg_thread``); when it ends, put the load
    (``load_average``) and the block's seconds into ``report`` as ``load_average_1min`` and ``total_runtime_s``."""
    samples: list[tuple[float, float, float | None]] = []
    before = os.getloadavg()[0]
    stop = threading.Event()
    sampler = load_avg_thread(samples, stop)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stop.set()
        sampler.join()
    report["load_average_1min"] = load_average(before, samples)
    report["total_runtime_s"] = time.perf_counter() - t0


#: Keys of a report that hold raw samples: written to ``<name>.samples.json``, not to the summary.
RAW_KEYS = ("records", "samples", "repeats_raw")


def write_report(out: str, name: str, report: dict[str, Any], md: str, markdown: str | None = None) -> None:
    """The summary as ``<out>/<name>.json`` (without the raw samples, which go to ``<name>.samples.json``)
    and the Markdown ``md`` as ``<out>/<name>.md`` (and at ``markdown``)."""
    missing = [k for k in ("command", "date", "machine") if k not in report]
    if missing:
        raise ValueError(f"a result names its command, date and machine; {name} lacks {', '.join(missing)}")
    os.makedirs(out, exist_ok=True)
    raw = {k: report[k] for k in RAW_KEYS if k in report}
    load = report.get("load_average_1min")
    if isinstance(load, dict) and "samples_time_load1_othercores" in load:
        raw["load_samples"] = load["samples_time_load1_othercores"]
    summary_only = {k: v for k, v in report.items() if k not in RAW_KEYS}
    if "load_samples" in raw:
        summary_only["load_average_1min"] = {k: v for k, v in load.items() if k != "samples_time_load1_othercores"}
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(summary_only, f, indent=2)
    if raw:
        with open(os.path.join(out, f"{name}.samples.json"), "w") as f:
            json.dump(raw, f)
    for path in filter(None, (os.path.join(out, f"{name}.md"), markdown)):
        with open(path, "w") as f:
            f.write(md)


def table(header: list[str], rows: list[list[Any]], right: int = 0) -> list[str]:
    """A Markdown table: ``header``, then ``rows`` (``None`` cells empty); the last ``right`` columns right-aligned."""
    align = ["---"] * (len(header) - right) + ["---:"] * right
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    for row in rows:
        lines.append("| " + " | ".join("" if c is None else str(c) for c in row) + " |")
    return lines


def targets_table(rows: list[dict[str, Any]], digits: int = 3) -> list[str]:
    """The targets as the one "target | measured | target | met" table every report shows."""
    out = []
    for t in rows:
        met = {True: "yes", False: "no", None: "n/a"}[t["met"]]
        value = "n/a" if t["measured"] is None else f"{t['measured']:.{digits}f}"
        out.append([t["target"], value, f"{t['direction']} {t['threshold']:g}", met])
    return table(["target", "measured", "target", "met"], out)


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
        line += f" Load average (1 min): median {load['median']:.2f}, max {load['max']:.2f}"
        cores = load.get("other_processes_cpu_cores")
        line += f"; other processes used {cores['mean']:.2f} cores on average." if cores else "."
    return line


def fmt(s: dict[str, Any], digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def mib(n: float | None) -> str:
    return "" if n is None else f"{n / MIB:,.0f}"
