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


#: Cluster jobs started before their tests run (``start_early``), by name, until their fixture takes them.
EARLY: dict[str, ClusterJob] = {}
#: "0": each cluster job starts when its tests run, not before.
EARLY_ENV = "RAYCKPT_TESTS_EARLY_JOBS"


class ClusterJob:
    """``python -m <module> OUT ARGS...`` running in the background, from the repository root, without
    ``RAY_ADDRESS`` and with ``env`` added; its output goes to ``OUT/job.out`` and ``OUT/job.err``."""

    def __init__(self, module: str, out: Path, *args: str, env: Mapping[str, str] = {}) -> None:
        environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        environ.update(env, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        self.module, self.out = module, out
        with open(out / "job.out", "w") as stdout, open(out / "job.err", "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, str(out), *args], cwd=ROOT, env=environ, stdout=stdout, stderr=stderr
            )

    def result(self, timeout: float) -> dict[str, Any]:
        """Wait for the job (killed past ``timeout`` seconds from now); its ``OUT/result.json`` with ``"out"``."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.module} still running after {timeout} s: {self.tail()}") from None
        assert code == 0, f"{self.module} exited with {code}: {self.tail()}"
        with open(self.out / "result.json") as f:
            return {**json.load(f), "out": self.out}

    def tail(self) -> str:
        return (self.out / "job.out").read_text()[-3000:] + (self.out / "job.err").read_text()[-5000:]


def early_wanted(items: Any, test_file: str) -> bool:
    """Start a job early: some collected test (``items``) is in ``test_file`` and ``EARLY_ENV`` is not "0"."""
    return os.environ.get(EARLY_ENV) != "0" and any(item.nodeid.startswith(test_file) for item in items)


def start_early(name: str, module: str, out: Path, *args: str, env: Mapping[str, str] = {}) -> None:
    """Start a cluster job now, while other tiers run: its fixture takes it with ``early(name)``."""
    EARLY[name] = ClusterJob(module, out, *args, env=env)


def early(name: str) -> ClusterJob | None:
    """The job ``start_early`` started under ``name`` (``None``: none was)."""
    return EARLY.pop(name, None)


def stop_early() -> None:
    """Stop every job ``start_early`` started that no fixture took: SIGTERM, then SIGKILL after 30 s."""
    while EARLY:
        _, job = EARLY.popitem()
        job.proc.terminate()
        try:
            job.proc.wait(30)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            job.proc.wait()


def run_cluster_job(module: str, out: Path, *args: str, timeout: float, env: Mapping[str, str] = {}) -> dict[str, Any]:
    """Run a cluster job to its end (``ClusterJob``); its ``OUT/result.json`` with ``"out"``: ``out``."""
    return ClusterJob(module, out, *args, env=env).result(timeout)
