"""The time a save call blocks when no optimizer owns the state: plain tensors, copied before the call returns.

One process holds ``--size-gb`` GiB of plain CPU tensors (``--tensors`` of them, no
optimizer, no ``AppState``: nothing is copied beside training). Modes, side by side:

- ``copy``: every tensor copied into host buffers allocated (and touched) beforehand: the floor.
- ``dcp``: ``torch.distributed.checkpoint.async_save`` with one reused
  ``DefaultStager(StagingOptions(True, False, False, False))`` (pinned, staged before
  the call returns).
- ``rayckpt``: ``rayckpt.ray.save_async`` after ``prepare_staging`` (a local Ray): the copy spread
  over the cores the process may use (``StagingBuffer.copy_now``).
- ``rayckpt-1-thread``: the same, with ``LOCAL_WORLD_SIZE`` set to the core count for the call, so
  that the copy takes one thread (one memcpy per tensor, as with a rank per core).

A round runs every mode once, the order rotated from round to round; one save is the
call, timed, then the save waited for and removed. Warm-up rounds are not counted.
Reported per mode: the stall's median (min-max) over rounds and its ratio to ``dcp``'s
and ``copy``'s. Run::

    .venv/bin/python -m benchmarks.stall_plain --out bench_out/stall_plain

A run the docs cite goes to ``benchmarks/results/stall_plain_<hardware>_<yyyymmdd>.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.common.harness import load_sampled, machine_info, rotated, summary, write_report

MODES = ("copy", "dcp", "rayckpt", "rayckpt-1-thread")
#: ``StagingOptions`` (pinned, shared, async staging, non-blocking copy) of DCP's stager.
DCP_OPTIONS = (True, False, False, False)


def plain_state(size_gb: float, tensors: int) -> dict[str, torch.Tensor]:
    per = int(size_gb * 2**30) // 4 // tensors
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(per, generator=gen) for i in range(tensors)}


class Modes:
    """One process's saves of every mode, and what each needs made beforehand."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from rayckpt.ray import prepare_staging

        self.state = state
        self.buffers = [torch.empty_like(t).zero_() for t in state.values()]
        self.stager = DefaultStager(StagingOptions(*DCP_OPTIONS))
        prepare_staging(state, wait=True)

    def start(self, mode: str, path: str, step: int) -> Any:
        """Start one save of ``mode`` (the timed call); returns what waits for it."""
        if mode == "copy":
            for dst, src in zip(self.buffers, self.state.values()):
                dst.copy_(src)
            return lambda: None
        if mode == "dcp":
            import torch.distributed.checkpoint as dcp

            response = dcp.async_save(self.state, checkpoint_id=path, async_stager=self.stager)
            upload = getattr(response, "upload_completion", response)
            return upload.result
        from rayckpt.ray import save_async

        if mode == "rayckpt":
            return save_async(self.state, path, run="stall-plain", step=step).wait
        cores = len(os.sched_getaffinity(0))
        before = os.environ.get("LOCAL_WORLD_SIZE")
        os.environ["LOCAL_WORLD_SIZE"] = str(cores)  # every core taken by a rank: one copy thread
        try:
            return save_async(self.state, path, run="stall-plain", step=step).wait
        finally:
            if before is None:
                del os.environ["LOCAL_WORLD_SIZE"]
            else:
                os.environ["LOCAL_WORLD_SIZE"] = before

    def close(self) -> None:
        from rayckpt.ray import release_staging

        self.stager.close()
        release_staging()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    state = plain_state(args.size_gb, args.tensors)
    modes = Modes(state)
    root = tempfile.mkdtemp(prefix="stall-plain-", dir=args.tmp)
    stalls: dict[str, list[float]] = {m: [] for m in MODES}
    step = 0
    try:
        for rnd in range(-args.warmup, args.rounds):
            for mode in rotated(MODES, rnd):
                step += 1
                path = os.path.join(root, f"{mode}-{step}")
                start = time.perf_counter()
                wait = modes.start(mode, path, step)
                stall = time.perf_counter() - start
                wait()
                shutil.rmtree(path, ignore_errors=True)
                if rnd >= 0:
                    stalls[mode].append(stall)
    finally:
        modes.close()
        shutil.rmtree(root, ignore_errors=True)
        ray.shutdown()
    return {m: summary(v, int(args.size_gb * 2**30)) for m, v in stalls.items()}


def markdown(report: dict[str, Any]) -> str:
    a, res = report["args"], report["stall_s"]
    dcp, copy = res["dcp"]["median"], res["copy"]["median"]
    load = report["load_average_1min"]
    m = report["machine"]
    lines = [
        "## Save stall of a state no optimizer owns: plain tensors, copied before the call returns",
        "",
        f"`python -m benchmarks.stall_plain --size-gb {a['size_gb']} --tensors {a['tensors']} --rounds {a['rounds']}` "
        f"on {report['started']}, {report['total_runtime_s'] / 60:.1f} min: {m['nproc']} CPUs, "
        f"{m['mem_total_gb']:.0f} GB RAM, torch {m['torch']}, pyarrow {m['pyarrow']}, rayckpt {m['rayckpt']}. "
        f"1-minute load average {load['before_start']:.2f} before the start; during the run median "
        f"{load['median']:.2f}, max {load['max']:.2f}.",
        "",
        f"State: {a['size_gb']} GiB of plain fp32 CPU tensors ({a['tensors']} of them) in one process. Modes: "
        "`copy`: every tensor copied into buffers allocated beforehand; `dcp`: `async_save` with one reused "
        "`DefaultStager(StagingOptions(True, False, False, False))`; `rayckpt`: `save_async` after "
        "`prepare_staging`, its copy spread over the process's cores; `rayckpt-1-thread`: the same with one "
        "copy thread. "
        f"{a['rounds']} rounds after {a['warmup']} warm-up round(s), modes rotated; "
        "seconds: median (min-max) over rounds.",
        "",
        "| mode | stall s | x DCP | x copy |",
        "| --- | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        s = res[mode]
        lines.append(
            f"| {mode} | {s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f}) | {s['median'] / dcp:.2f} "
            f"| {s['median'] / copy:.2f} |"
        )
    lines += ["", f"rayckpt / DCP (medians): {res['rayckpt']['median'] / dcp:.3f}", ""]
    lines += [f"rayckpt-1-thread / DCP (medians): {res['rayckpt-1-thread']['median'] / dcp:.3f}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stall_plain", description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tmp", default=None, help="where the saves go (default: the system's temporary directory)")
    parser.add_argument("--out", default="bench_out/stall_plain")
    parser.add_argument("--name", default="stall_plain")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "args": vars(args),
        "machine": machine_info(),
        "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    with load_sampled(report):
        report["stall_s"] = run(args)
    res = report["stall_s"]
    report["rayckpt_over_dcp"] = res["rayckpt"]["median"] / res["dcp"]["median"]
    report["rayckpt_over_copy"] = res["rayckpt"]["median"] / res["copy"]["median"]
    os.makedirs(args.out, exist_ok=True)
    md = markdown(report)
    write_report(args.out, args.name, report, md)
    print(md)
    print("medians:", {m: round(statistics.median(res[m]["values"]), 4) for m in MODES})


if __name__ == "__main__":
    main()
