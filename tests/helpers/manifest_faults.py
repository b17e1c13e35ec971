"""Shared by the fault-injection tier (``tests/faults``): a run of saved checkpoints, targets, the CLI in-process."""

from __future__ import annotations

import contextlib
import io
import os

import torch

import rayckpt
from rayckpt.cli import commands as cli
from rayckpt.storage.catalog import checkpoint_dir_name
from tests.helpers.checkpoints import make_state


def save_run(run_dir, steps=(1, 2, 3)) -> dict[int, tuple[str, dict]]:
    """Checkpoints ``rayckpt-step-<step>`` of ``make_state(step)`` under ``run_dir``: step -> (path, state)."""
    out = {}
    for step in steps:
        path = os.path.join(run_dir, checkpoint_dir_name(step))
        state = make_state(step)
        rayckpt.save(state, path, block_size=32, metadata={"step": step})
        out[step] = (path, state)
    return out


def empty_like(state: dict) -> dict:
    """A target for ``make_state``'s checkpoints, filled with a sentinel (so a partial load shows)."""
    return {
        "model": {k: torch.full_like(v, 7) for k, v in state["model"].items()},
        "step": 0,
        "config": None,
    }


def assert_loads_bit_exact(path: str, state: dict) -> None:
    target = empty_like(state)
    rayckpt.load(target, path)
    for k, v in state["model"].items():
        assert target["model"][k].dtype == v.dtype and torch.equal(target["model"][k], v), k
    assert target["step"] == state["step"]


def run_cli(*args: str) -> tuple[int, str, str]:
    """``rayckpt ARGS`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(list(args))
    return status, out.getvalue(), err.getvalue()


def assert_one_line_error(err: str, *needles: str) -> None:
    """The CLI printed one error line (no traceback) containing every needle."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayckpt: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
