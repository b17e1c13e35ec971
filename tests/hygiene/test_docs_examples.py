"""Every Python code block of README.md and docs/ runs, or says why not.

A block runs as written, in a fresh interpreter in a temporary directory, after the
prelude an HTML comment right above it names (``<!-- run with: NAME -->``, from
``PRELUDES`` below: the names the text takes as given, such as ``model``) and before
its checks (``CHECKS``). A block that cannot run here says so and why, right above it:
``<!-- not run: needs a Ray cluster with GPUs -->``."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!-- (run with|not run): *(.*?) *-->\s*$")

PRELUDES = {
    # One gloo rank of an FSDP2 toy model with AdamW and an LR scheduler, trained a
    # little: the "initialized process group, FSDP2 model" the quick start starts from.
    "fsdp_one_rank": """
        import os, socket
        import torch
        import torch.distributed as dist
        from rayckpt.testing.toy import ToyModel, build_fsdp, train_steps

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1)
        model, optimizer = build_fsdp(1, seed=0)
        train_steps(model, optimizer, 2, rank=0)
        lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
        step = 100
        MyModel = ToyModel
    """,
}
CHECKS = {
    "fsdp_one_rank": """
        assert step == 100, step
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert all(torch.equal(full[k], v) for k, v in plain.state_dict().items())
        dist.destroy_process_group()
    """,
}


def blocks() -> list[tuple[str, str, str | None, str | None]]:
    """(where, code, mark kind, mark text) of every Python block."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            above = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.fullmatch(above)
            where = f"{page.relative_to(ROOT)}:{line}"
            found.append((where, m.group(1), mark.group(1) if mark else None, mark.group(2) if mark else None))
    return found


BLOCKS = blocks()


def test_every_block_is_found():
    assert any(where.startswith("README.md") for where, *_ in BLOCKS)


@pytest.mark.parametrize("where,code,kind,text", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs_or_says_why_not(where, code, kind, text, tmp_path):
    if kind == "not run":
        assert len(text) > 10, f"{where}: say why the block does not run"
        return
    prelude = ""
    checks = ""
    if kind == "run with":
        assert text in PRELUDES, f"{where}: no prelude {text!r} in {__name__}.PRELUDES"
        prelude, checks = textwrap.dedent(PRELUDES[text]), textwrap.dedent(CHECKS.get(text, ""))
    script = tmp_path / "example.py"
    script.write_text(prelude + "\n" + code + "\n" + checks, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, f"{where} failed:\n{done.stdout}{done.stderr}"
