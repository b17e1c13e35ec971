"""The overlap benchmark's arithmetic: made-up per-rank records in, exact medians, ratios and tables out.

``benchmarks.overlap stall`` and ``step`` measure on a real Ray; what they report is
computed from their records alone (``benchmarks.overlap.report``), so a wrong
"slowest rank", a counted first step or a wrong ratio fails these tests.
"""

from __future__ import annotations

import pytest

from benchmarks.common.workload import StackShape, stack_shape
from benchmarks.overlap.report import (
    stall_markdown,
    stall_targets,
    step_markdown,
    summarize_stall,
    summarize_step,
)

MACHINE = {"nproc": 2, "mem_total_gb": 25, "torch": "t", "ray": "r", "pyarrow": "p", "rayckpt": "x", "device": "cpu"}
#: Per mode, per round, per rank: the stall in seconds.
STALLS = {
    "copy": [[0.10, 0.12], [0.11, 0.09], [0.10, 0.10]],
    "dcp": [[0.40, 0.20], [0.30, 0.30], [0.50, 0.10]],
    "rayckpt": [[0.02, 0.06], [0.03, 0.01], [0.04, 0.02]],
}


def stall_records() -> list[dict]:
    out = []
    for mode, rounds in STALLS.items():
        for rnd, ranks in enumerate(rounds):
            for rank, stall in enumerate(ranks):
                late = 3 * 2**20 if mode == "rayckpt" else 0
                copy = 0.2 + rank if mode == "rayckpt" else None
                out.append(
                    {"round": rnd, "mode": mode, "rank": rank, "stall_s": stall, "staged_wait_s": 0.0,
                     "opt_wait_s": 0.01 * rank, "total_s": 1.0 + rnd, "late_bytes": late, "copy_s": copy}
                )  # fmt: skip
    return out


def test_stall_takes_each_rounds_slowest_rank_then_the_median_over_rounds():
    s = summarize_stall(stall_records(), {"dcp-async-staging": "KeyError: boom"})
    assert s["dcp"]["stall_slowest"]["values"] == [0.40, 0.30, 0.50]
    assert s["dcp"]["stall_slowest"]["median"] == pytest.approx(0.40)
    assert s["dcp"]["stall_rank_median"]["median"] == pytest.approx(0.30)  # medians 0.30, 0.30, 0.30
    assert s["rayckpt"]["stall_slowest"]["median"] == pytest.approx(0.04)  # 0.06, 0.03, 0.04
    assert s["rayckpt"]["step_waited_s"] == pytest.approx(0.01)
    assert s["rayckpt"]["copy_s"] == pytest.approx(1.2)
    assert s["rayckpt"]["late_bytes"] == 3 * 2**20
    assert s["copy"]["copy_s"] is None
    assert s["dcp"]["total_s"] == pytest.approx(2.0)
    assert (s["rayckpt"]["ranks"], s["rayckpt"]["rounds"]) == (2, 3)
    assert s["dcp-async-staging"] == {"error": "KeyError: boom"}


def test_stall_targets_and_table():
    summary = {"four-ranks": summarize_stall(stall_records(), {"dcp-async-staging": "KeyError: boom"})}
    targets = stall_targets(summary)
    assert targets[0]["measured"] == pytest.approx(0.04 / 0.40)
    assert targets[0]["met"] is True
    assert targets[1]["measured"] == pytest.approx(0.04) and targets[1]["met"] is False
    # Plain tensors: every mode copies before it returns; the one target is the stall at most DCP's.
    (plain,) = stall_targets(summary, plain=True)
    assert plain["measured"] == pytest.approx(0.04 / 0.40) and plain["met"] is True
    assert (plain["direction"], plain["threshold"]) == ("<=", 1.0)
    report = {
        "command": "python -m benchmarks.overlap stall --size-gb 1",
        "date": "today",
        "total_runtime_s": 90.0,
        "machine": MACHINE,
        "config": {"batch": 8, "rounds": 3, "warmup": 1, "workers": 4},
        "shape": {"width": 4729, "layers": 4},
        "state_bytes": 2**30,
        "summary": summary,
        "targets": targets,
    }
    md = stall_markdown(report)
    assert "python -m benchmarks.overlap stall --size-gb 1" in md and "2 CPUs" in md
    assert "| four-ranks | rayckpt | 0.0400 (0.0300-0.0600) | 0.0300 | 0.100 | 0.364 | 0.0100 | 2 | 3 |" in md
    assert "| four-ranks | dcp | 0.400 (0.300-0.500) | 0.300 | 1 | 3.64 |" in md
    assert "| four-ranks | dcp-async-staging | KeyError: boom |" in md
    assert "| four-ranks: stall, rayckpt / DCP | 0.100 | <= 0.25 | yes |" in md
    assert "| four-ranks: stall, rayckpt, s | 0.0400 | <= 0.03 | no |" in md


def step_records() -> list[dict]:
    """2 workers, one round of none and memory, 3 steps each, a save every step; worker 1 slower."""
    out, step = [], 0
    for mode, base in (("none", 1.0), ("memory", 1.2)):
        for i in range(3):
            step += 1
            for rank in range(2):
                slow = 0.1 * rank + (5.0 if i == 0 else 0.01 * i)  # a round's first step: never counted
                out.append(
                    {"every": 1, "round": 0, "mode": mode, "i": i, "step": step, "rank": rank,
                     "step_s": base + slow, "save_s": 0.02 * (mode == "memory") * (rank + 1),
                     "wait_s": 0.05 * (mode == "memory"), "saved": mode != "none",
                     "skipped": (i == 2) if mode == "memory" else None}
                )  # fmt: skip
    return out


def test_step_counts_the_slowest_worker_past_each_rounds_first_step():
    s = summarize_step(step_records())["1"]
    assert s["none"]["steps"] == 2
    assert s["none"]["step_median_s"] == pytest.approx(1.0 + 0.1 + 0.015)  # 1.11 and 1.12
    assert s["none"]["step_mean_s"] == pytest.approx(1.115)
    assert s["memory"]["step_median_s"] == pytest.approx(1.315)
    assert s["memory"]["save_call_s"] == pytest.approx(0.04)  # step 2 (step 3 skipped, step 1 not counted)
    assert s["memory"]["wait_mean_s"] == pytest.approx(0.05)
    assert (s["memory"]["saves"], s["memory"]["skipped"]) == (3, 1)
    assert (s["none"]["saves"], s["none"]["save_call_s"]) == (0, None)


def test_step_table():
    report = {
        "command": "python -m benchmarks.overlap step",
        "date": "today",
        "total_runtime_s": 600.0,
        "machine": MACHINE,
        "config": {"workers": 2, "batch": 8, "rounds": 1, "steps": 3},
        "shape": {"width": 4729, "layers": 4},
        "state_bytes": 2**30,
        "summary": summarize_step(step_records()),
        "notes": ["memory-sync: not run"],
    }
    md = step_markdown(report)
    assert "| 1 | none | 1.12 | 1 |  | 1.12 | 1 |  | 0 |  |" in md
    assert "| 1 | memory | 1.31 | 1.18 |  | 1.31 | 1.18 | 0.0400 | 0.0500 | 1 of 3 |" in md
    assert md.rstrip().endswith("- memory-sync: not run")


def test_the_stack_holds_the_asked_state():
    shape = stack_shape(1.0, 4)
    assert shape == StackShape(width=4729, layers=4)
    assert shape.state_bytes == 12 * 4 * (4729 * 4729 + 4729)
    assert abs(shape.state_bytes - 2**30) / 2**30 < 0.01
