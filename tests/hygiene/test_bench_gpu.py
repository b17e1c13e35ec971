"""The GPU benchmark's report: a failing DCP stager is a row with its error, ratios come from the saves."""

from __future__ import annotations

from benchmarks.common.harness import table
from benchmarks.gpu.run import rows as gpu_rows


def report() -> dict:
    saves = [{"stall_s": 0.3, "commit_s": 2.0}, {"stall_s": 0.1, "commit_s": 1.0}, {"stall_s": 0.1, "commit_s": 1.0}]
    return {
        "copy": {"limit_s": 0.078, "pageable_s": 3.85},
        "dcp": {
            "save_s": 5.1,
            "async": {
                "default stager": {"stall_median_s": 2.9, "save_s": 7.9},
                "pinned + async staging": {"error": "KeyError: <class 'type'>"},
            },
        },
        "rayckpt": {"save_s": 3.9},
        "save_async": {
            "unprepared": {"saves": saves, "first_over_later_stall": 3.0},
            "prepared": {
                "saves": saves[1:],
                "first_over_later_stall": 1.0,
                "prepare_call_s": 0.002,
                "prepare_background_s": 2.5,
            },
        },
        "loads": {"dcp_cold_s": 4.2, "rayckpt_cold_s": 2.9, "dcp_warm_s": 3.3, "rayckpt_warm_s": 1.0},
    }


def test_the_table_shows_a_failing_stager_as_its_error_and_the_first_over_later_ratio():
    rows = table(gpu_rows(report()))
    assert "| DCP `async_save`, pinned + async staging: stall / total | KeyError: <class 'type'> |" in rows
    assert "| DCP `async_save`, default stager: stall / total | 2.900 s / 7.90 s |" in rows
    unprepared = next(r for r in rows if r.startswith("| rayckpt `save_async`, unprepared: stall"))
    assert "0.300, 0.100, 0.100 s (first / later: 3.00x)" in unprepared
    prepared = next(r for r in rows if r.startswith("| rayckpt `save_async`, prepared: stall"))
    assert "prepare_staging: 0.002 s call, 2.50 s made" in prepared
    assert "| load, cold: DCP / rayckpt | 4.20 s / 2.90 s (1.45x) |" in rows
