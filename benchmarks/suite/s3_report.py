"""The object-storage benchmark's report: its targets and its markdown section "Object storage".

Nothing here measures: it turns the report ``suite.s3`` assembled (also written as
``bench_s3.json``) into target rows (``s3_targets``) and markdown (``s3_markdown``).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common.harness import MIB, fmt, ratio_row
from benchmarks.suite.s3_counter import largest_class
from benchmarks.suite.s3_ranks import S3_LABELS, S3_LOAD_SYSTEMS, S3_SAVE_SYSTEMS

#: rayckpt's bytes fetched per byte needed on an S3 reshard load, at most.
READ_AMP_TARGET = 1.05


def s3_targets(size: dict[str, Any], main_reshard: str) -> list[dict[str, Any]]:
    """Target rows of one size: read amplification per reshard, the main reshard's speed-up, save and stall."""
    rows = []
    for name, ld in size["load"].items():
        row = ratio_row(
            f"read amplification, S3 reshard {name}: rayckpt",
            statistics.median(ld["rayckpt"]["read_amplification"]),
            READ_AMP_TARGET,
            False,
            "object GET body bytes the server sent / payload bytes the ranks needed (median over repeats)",
        )
        row["dcp"] = statistics.median(ld["dcp"]["read_amplification"])
        row["dcp_nocache"] = statistics.median(ld["dcp_nocache"]["read_amplification"])
        rows.append(row)
    ld = size["load"].get(main_reshard)
    if ld:
        for system, label in (("dcp", "DCP"), ("dcp_nocache", "DCP without read-ahead")):
            rows.append(
                ratio_row(
                    f"reshard load {main_reshard} from S3: {label} time / rayckpt time",
                    ld[system]["wall_s"]["median"] / ld["rayckpt"]["wall_s"]["median"],
                    1.5,
                    True,
                    "median load time (max over ranks) of DCP's FsspecReader / rayckpt's",
                )
            )
    s = size["save"]
    dcp_save = s["dcp"]["commit_s"]["median"]
    for system, label in (("rayckpt", "rayckpt.save (sync)"), ("rayckpt_ray", "rayckpt Ray save_async")):
        rows.append(
            ratio_row(
                f"save commit on S3: {label} / DCP FsspecWriter save",
                s[system]["commit_s"]["median"] / dcp_save,
                1.0,
                False,
                "median barrier-to-committed time (max over ranks) / median dcp.save",
            )
        )
    rows.append(
        ratio_row(
            "save stall on S3: rayckpt Ray save_async / DCP FsspecWriter save",
            s["rayckpt_ray"]["stall_s"]["median"] / dcp_save,
            0.2,
            False,
            "median SaveHandle.stall_seconds (max over ranks) / median dcp.save",
        )
    )
    return rows


def mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def med(values: list[float]) -> float:
    return statistics.median(values)


def s3_markdown(report: dict[str, Any]) -> str:
    """The section: the run, per size the save, load and target tables, then the method."""
    m = report["machine"]
    la = report["load_average_1min"]
    lines = [
        "## Object storage",
        "",
        f"`{report['command']}` on {report['date']}, {report['total_runtime_s'] / 60:.0f} min: "
        f"{m['nproc']} CPUs, {m['mem_total_gb']:.0f} GB RAM, torch {m['torch']}, pyarrow {m['pyarrow']}, "
        f"Ray {m['ray']}, moto {m['moto']}, s3fs {m['s3fs']} (aiobotocore {m['aiobotocore']}). "
        f"Load average (1 min) during the run: median {la['median']:.1f}, max {la['max']:.1f}; other processes "
        f"used {la['other_processes_cpu_cores']['mean']:.2f} cores on average.",
    ]
    for key, size in report["sizes"].items():
        lines += size_lines(key, size)
    lines += method_lines()
    return "\n".join(lines) + "\n"


def size_lines(key: str, size: dict[str, Any]) -> list[str]:
    n0 = size["save_ranks"]
    lines = [
        "",
        f"### {size['state_bytes'] / 1e9:.3f} GB state ({key}), S3",
        "",
        f"Save, {n0} ranks. Seconds: median (min-max) over repeats, max over ranks. "
        "Requests and bytes: counted by the server, median over repeats.",
        "",
        "| system | stall s | commit s | GB/s | PUTs | MiB uploaded | all requests |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for system in S3_SAVE_SYSTEMS:
        s = size["save"][system]
        sv = s["server"]
        lines.append(
            f"| {S3_LABELS[system] if system != 'rayckpt' else 'rayckpt.save'} | {fmt(s['stall_s'])} | "
            f"{fmt(s['commit_s'])} | {s['commit_s'].get('GBps_median', 0):.3f} | {med(sv['put_requests']):.0f} | "
            f"{mib(med(sv['put_bytes']))} | {med(sv['all_requests']):.0f} |"
        )
    lines += [
        "",
        "Reshard loads. Time: median (min-max) over repeats, max over ranks. GETs and MiB sent: object GETs "
        "counted by the server (all ranks; median over repeats; GETs < 4 KiB and the largest GET's size class: "
        "first repeat); read amplification = MiB sent / MiB needed "
        "(the ranks' payload). rayckpt's own `LoadInfo` (sum over ranks of `requests` / `bytes_fetched`) is "
        "shown next to the server's count.",
        "",
        "| reshard | system | time s | GB/s | GETs | GETs < 4 KiB | MiB sent | MiB needed | read ampl. | "
        "largest GET | LoadInfo GETs / MiB | verified |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, ld in size["load"].items():
        needed = sum(ld["bytes_needed_per_rank"])
        for system in S3_LOAD_SYSTEMS:
            e = ld[system]
            sv = e["server"]
            gets = sv["by_kind_first_repeat"].get("GET_object", {})
            largest = largest_class(gets)
            small = sum(v for k, v in gets.items() if k.startswith("out<2^") and int(k[6:]) <= 12)
            info = e.get("loadinfo")
            own = f"{med(info['requests']):.0f} / {mib(med(info['bytes_fetched']))}" if info else ""
            verified = f"{e['verified_tensors']} tensors bit-exact" if e.get("verified_tensors") else "no"
            lines.append(
                f"| {name} | {S3_LABELS[system]} | {fmt(e['wall_s'])} | {e['wall_s'].get('GBps_median', 0):.3f} | "
                f"{med(sv['get_requests']):.0f} | {small} | {mib(med(sv['get_bytes']))} | {mib(needed)} | "
                f"{med(e['read_amplification']):.3f} | < {mib(largest)} MiB | {own} | {verified} |"
            )
    lines += [
        "",
        "| target | measured | DCP | DCP, no read-ahead | target | met |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for t in size["targets"]:
        dcp = " | ".join(f"{t[k]:.3f}" if k in t else "" for k in ("dcp", "dcp_nocache"))
        met = "met" if t["met"] else "NOT met"
        lines.append(f"| {t['target']} | {t['measured']:.3f} | {dcp} | {t['direction']} {t['threshold']:g} | {met} |")
    return lines


def method_lines() -> list[str]:
    return [
        "",
        "### Method (object storage)",
        "",
        "- Endpoint: moto's S3 server as its own process on 127.0.0.1 (started by `rayckpt.testing.s3_server`, "
        "as the S3 test tier starts it), serving moto's WSGI app through `benchmarks/s3_counter.py`, a "
        "middleware that counts every request by kind (object GET, listing GET, HEAD, PUT, POST, DELETE) with "
        "its response body bytes (counted as the server sends them) and request body bytes (from the headers). "
        "Rank 0 reads the counters (`GET /_counts`) right before and after each timed operation (the other "
        "ranks wait in the barrier), so GETs and bytes are the server's, for both systems alike.",
        "- rayckpt: `s3://` URIs with the endpoint in the query string (pyarrow's `S3FileSystem`: ranged GETs "
        "coalesced and run 8 at a time per rank; multipart uploads). DCP: `FsspecWriter` / `FsspecReader` with "
        "`s3fs` (defaults: its read-ahead cache and block size, one file per rank), a fresh `s3fs` instance per "
        "operation (`skip_instance_cache=True`: no listing cache carried over, as in a new process). DCP's loads "
        "run twice: with s3fs's defaults (a read-ahead cache that fetches a block, 50 MiB, past each read) "
        "and with `default_cache_type='none'` (each read fetches what it asks for); the targets use the "
        "defaults, the second is shown next to them.",
        "- Saves on 4 gloo ranks, systems alternated within each repeat, order rotating between repeats; the "
        "target is emptied (untimed) before each save. Stall = time the calling rank is blocked (the whole "
        "call for synchronous saves; `SaveHandle.stall_seconds` for the Ray save, its staging buffer made "
        "before the repeats); commit = barrier before the call until committed (`handle.wait()`).",
        "- Loads: M fresh ranks (a differently seeded state) load the N-rank checkpoints of the last save "
        "repeat; the first load of each system goes into a zeroed state and is checked bit-exact against "
        "checksums of every saved param and moment. 2-rank checkpoints are saved by the 4->2 ranks.",
        "- The endpoint's own costs: moto stores each object in a spooled temporary file and its own "
        "GetObject reads (and copies) the whole object for every ranged GET, so a GET would cost time in "
        "proportion to its object, not its range; the middleware serves plain ranged GETs from the range of "
        "the stored object instead (`range_in_place`: the same bytes and headers; `--moto-ranges` keeps "
        "moto's path). The server is werkzeug's threaded development server (one TCP connection per request, "
        "Python, one GIL) on the same 2 cores as the ranks: times are bounded by the endpoint and the CPU, "
        "not by a network, and a real store serves many GETs in parallel. GET counts, bytes sent and read "
        "amplification do not depend on the endpoint's speed.",
    ]
