"""What the hosts benchmarks share: their command-line options, the report's head, and a driver run on a host."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common.harness import run_line
from testbed.hosts import Host, hosts_unavailable

#: The repository's root: the drivers on the hosts run there.
ROOT = Path(__file__).resolve().parents[2]
#: Every host process's environment: a driver's and Ray's workers import ``benchmarks`` from the repository.
HOST_ENV = {"PYTHONPATH": str(ROOT)}
#: The flag a sub-command's module takes to run as the driver on a host.
ON_HOST = "--on-host"


def require_hosts() -> None:
    """Exit with the reason when hosts cannot be built here (root, ``ip``, ``unshare``...)."""
    reason = hosts_unavailable()
    if reason is not None:
        raise SystemExit(f"benchmarks.hosts: {reason}")


def head_lines(report: dict[str, Any], title: str) -> list[str]:
    """The Markdown's first lines: the title, then the command, the machine, the versions and the load."""
    return [f"## {title}", "", run_line(report), ""]


def run_on_host(host: Host, module: str, config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``python -m module --on-host CONFIG`` on ``host`` from the repository root; its last line, parsed."""
    proc = host.run([sys.executable, "-m", module, ON_HOST, json.dumps(config)], cwd=str(ROOT), timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{module} failed on host {host.index} ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def connect(address: str) -> None:
    """A driver on a host joins the cluster, quietly, in rayckpt's namespace (where the ShardWriters are)."""
    import logging

    import ray

    from rayckpt.ray.actors import NAMESPACE

    ray.init(address=address, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)


def node_id_of(ip: str) -> str:
    """The id of the alive Ray node at ``ip`` (a driver's view)."""
    import ray

    for node in ray.nodes():
        if node["Alive"] and node["NodeManagerAddress"] == ip:
            return node["NodeID"]
    raise RuntimeError(f"no alive Ray node at {ip}")
