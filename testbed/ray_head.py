"""A Ray head started as a user starts one (`ray start --head`), on this machine, for tests and benchmarks.

Each head has its own ``--temp-dir`` and free loopback ports, and is stopped by
signalling its own process (then its process group), so it never touches another
Ray on the machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

#: The environment's executables (``ray``, ``rayckpt``).
BIN = os.path.dirname(sys.executable)
START_TIMEOUT_S = 120
STOP_GRACE_S = 3
#: How often the dashboard is asked whether it is up while the head starts.
POLL_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held open while picked, so none repeats)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@dataclass(frozen=True, slots=True, kw_only=True)
class RayHead:
    """A running head node: where to reach it and the environment its processes (and submits) run with."""

    env: dict[str, str]
    dashboard: str
    metrics: str
    address: str
    temp_dir: str


@contextmanager
def ray_head(temp_dir: str, extra_env: Mapping[str, str] | None = None, num_cpus: int = 8) -> Iterator[RayHead]:
    """A head node started with `ray start --head --block` (``num_cpus`` CPUs, token authentication off, its own
    ``temp_dir`` and free ports), up once its dashboard answers; stopped by signalling it and its process group.

    ``extra_env`` goes into the head's environment, so every Ray process, job driver
    and Train worker of the cluster inherits it (as from a node's configuration).
    """
    # Every port Ray would otherwise take at a fixed default (the agent's 52365, the client server's 10001):
    # another Ray on the machine may hold it, and the head's job agent then never comes up.
    names = ("gcs", "dashboard", "metrics", "agent", "client")
    ports = dict(zip(names, free_ports(len(names))))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(extra_env or {})
    env.update(RAY_AUTH_MODE="disabled", PATH=f"{BIN}:{env.get('PATH', '')}")
    head = subprocess.Popen(
        [
            f"{BIN}/ray",
            "start",
            "--head",
            "--block",
            "--port",
            str(ports["gcs"]),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(ports["dashboard"]),
            "--metrics-export-port",
            str(ports["metrics"]),
            "--dashboard-agent-listen-port",
            str(ports["agent"]),
            "--ray-client-server-port",
            str(ports["client"]),
            "--num-cpus",
            str(num_cpus),
            "--temp-dir",
            temp_dir,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        dashboard = f"http://127.0.0.1:{ports['dashboard']}"
        deadline = time.time() + START_TIMEOUT_S
        while True:
            try:
                get(f"{dashboard}/api/jobs/")
                break
            except OSError:
                if time.time() > deadline or head.poll() is not None:
                    raise RuntimeError("ray start --head did not bring up the dashboard") from None
                time.sleep(POLL_S)
        yield RayHead(
            env=env,
            dashboard=dashboard,
            metrics=f"http://127.0.0.1:{ports['metrics']}/metrics",
            address=f"127.0.0.1:{ports['gcs']}",
            temp_dir=temp_dir,
        )
    finally:
        # `ray start` stops its processes itself on SIGTERM (a SIGTERM to the whole group at once leaves
        # it waiting past any timeout); after jobs ran it may still wait on some: the group is then killed.
        os.kill(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
