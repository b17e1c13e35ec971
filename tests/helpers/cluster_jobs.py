"""Run a ``tests.helpers`` module that builds its own Ray ``Cluster`` as a subprocess; read its ``result.json``.

The pytest process holds the session's local Ray (``ray_session``), so a test that
needs several Ray nodes runs them in a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cluster_job(module: str, out: Path, *args: str, timeout: float, env: Mapping[str, str] = {}) -> dict[str, Any]:
    """``python -m <module> OUT ARGS...`` from the repository root, without ``RAY_ADDRESS`` and with ``env``
    added; its ``OUT/result.json`` with ``"out"``: ``out``."""
    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    environ.update(env, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(
        [sys.executable, "-m", module, str(out), *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "result.json") as f:
        return {**json.load(f), "out": out}
