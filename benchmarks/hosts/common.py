"""What the hosts benchmarks share: a driver run on a host, from the repository."""

from __future__ import annotations

import json
import sys
from typing import Any

from benchmarks.common.harness import REPO_ROOT as ROOT
from testbed.hosts import Host, hosts_unavailable

#: Every host process's environment: a driver's and Ray's workers import ``benchmarks`` from the repository.
HOST_ENV = {"PYTHONPATH": str(ROOT)}
#: The flag a sub-command's module takes to run as the driver on a host.
ON_HOST = "--on-host"


def require_hosts() -> None:
    """Exit with the reason when hosts cannot be built here (root, ``ip``, ``unshare``...)."""
    reason = hosts_unavailable()
    if reason is not None:
        raise SystemExit(f"benchmarks.hosts: {reason}")


def run_on_host(host: Host, module: str, config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``python -m module --on-host CONFIG`` on ``host`` from the repository root; its last line, parsed."""
    proc = host.run([sys.executable, "-m", module, ON_HOST, json.dumps(config)], cwd=str(ROOT), timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{module} failed on host {host.index} ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])
