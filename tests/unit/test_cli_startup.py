"""The ``rayckpt`` command starts without torch or Ray for everything that reads no tensor.

Each command runs as a user runs it (``python -m rayckpt``, a fresh interpreter)
under ``-X importtime``, which names every module the process imported: torch
and ray must not be among them. ``inspect --tensor`` does import torch, which
shows the check sees it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import rayckpt

HEAVY = ("torch", "ray")
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(rayckpt.__file__)))


def top_level_imports(importtime_stderr: str) -> set[str]:
    """Top-level packages named by ``-X importtime`` lines ("import time: self | cumulative | name")."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            names.add(name.split(".")[0])
    return names


def run_cli(*args: str, cwd: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    # The rayckpt under test, whichever checkout the interpreter's installed one points to.
    pythonpath = os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "rayckpt", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r, top_level_imports(r.stderr)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    path = root / "storage" / "run" / "rayckpt-step-00000001"
    rayckpt.save({"w": torch.arange(12.0).reshape(4, 3), "step": 1}, str(path), metadata={"step": 1})
    return str(root), str(path)


def test_importing_the_cli_the_dashboard_or_the_alerts_brings_in_neither_torch_nor_ray():
    code = (
        "import json, sys; import rayckpt.cli, rayckpt.tools, rayckpt.observe.dashboard, rayckpt.observe.alerts; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_commands_that_read_no_tensor_start_without_torch_or_ray(ckpt):
    root, path = ckpt
    commands = {
        "help": ("--help",),
        "version": ("--version",),
        "command help": ("convert", "--help"),
        "ls": ("ls", os.path.join(root, "storage")),
        "inspect": ("inspect", path),
        "plan": ("plan", path, "--world-size", "3"),
        "verify": ("verify", path),
        "gc": ("gc", path, "--dry-run"),
        "rm dry": ("rm", os.path.join(root, "nothing-here")),  # an error path imports nothing heavy either
        "dashboard": ("dashboard", "export", os.path.join(root, "dashboard.json")),
        "alerts": ("dashboard", "alerts", os.path.join(root, "alerts.yml")),
        "tensor": ("inspect", path, "--tensor", "w"),
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run_cli, *args, cwd=root) for name, args in commands.items()}
        results = {name: f.result() for name, f in futures.items()}
    for name, (r, imported) in results.items():
        if name == "rm dry":
            assert r.returncode == 2 and "no such file or directory" in r.stderr, r.stderr[-500:]
        else:
            assert r.returncode == 0, (name, r.stdout, r.stderr[-2000:])
        if name == "tensor":
            assert "torch" in imported  # the check sees torch when it comes
            assert "ray" not in imported
        else:
            assert not imported & set(HEAVY), (name, sorted(imported & set(HEAVY)))
    assert results["version"][0].stdout.strip() == f"rayckpt {rayckpt.__version__}"
    assert "rm" in results["help"][0].stdout and "(default: 5GB)" in results["command help"][0].stdout
    assert "rayckpt-step-00000001" in results["ls"][0].stdout
    assert results["verify"][0].stdout.startswith("ok: ")
    assert "rayckpt Grafana dashboard" in results["dashboard"][0].stdout
    assert "rayckpt Prometheus alert rules" in results["alerts"][0].stdout
