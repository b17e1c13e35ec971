"""A Ray cluster on hosts of one machine (``testbed.hosts``): a Ray node on each, and an S3 host.

Host 0 runs ``ray start --head --block``, the others ``ray start --address <head> --block``,
each with its own address (``--node-ip-address``), CPUs and Ray temp dir, as on
machines of their own. Optionally one more host, without Ray, serves S3 (``moto_server``
on its own address). The address of the cluster and of the S3 endpoint are reachable
from the hosts only: run what talks to them on a host (``Host.run``, ``Host.python``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from rayckpt.testing.s3_server import S3_ENV, S3Endpoint
from testbed.hosts import BIN, Host, Hosts, build_hosts

T = TypeVar("T")

#: The head's GCS port and dashboard port on host 0, and the S3 host's port (each host has a network stack of
#: its own).
RAY_PORT = 6379
DASHBOARD_PORT = 8265
S3_PORT = 9000
START_TIMEOUT_S = 120.0
#: Every host process's environment has these. A node stops at once on SIGTERM rather than first asking
#: the GCS to drain it: a node cut off from the GCS would wait out the whole drain. Gloo (torch.distributed
#: on CPU) uses the host's own interface: by default it takes the address the hostname resolves to, and the
#: hosts share the machine's hostname (it resolves to loopback), where machines of their own would not.
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    "GLOO_SOCKET_IFNAME": "eth0",
    # A node joining asks the GCS for the head node this many times, 2 s apart (Ray's default 20): on a loaded
    # machine the head's node registers later than its GCS answers, which is when the others are started.
    "RAY_NUM_REDIS_GET_RETRIES": "60",
}

#: Ray's health checks of the nodes (its GCS's), tuned as docs/recovery.md recommends: a check every second, two
#: seconds to answer, four missed in a row and the node is dead. Ray reads them from ``RAY_<name>`` in the
#: environment of ``ray start``: ``build_ray_hosts(env=TUNED_HEALTH_CHECKS)``.
TUNED_HEALTH_CHECKS = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "4",
}

#: Run on host 0: wait until Ray has ``want`` alive nodes, then print their addresses, one a line.
_NODES_SNIPPET = """
import sys, time, ray
address, want, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:  # the head's GCS may answer before it knows the head node
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if len(alive) >= want or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print("\\n".join(alive))
"""

#: Run on the S3 host: create the bucket ``argv[2]`` at the endpoint ``argv[1]``.
_BUCKET_SNIPPET = """
import os, sys
import pyarrow.fs as pafs
pafs.S3FileSystem(
    endpoint_override=sys.argv[1], scheme="http", access_key=os.environ["AWS_ACCESS_KEY_ID"],
    secret_key=os.environ["AWS_SECRET_ACCESS_KEY"], region=os.environ["AWS_REGION"], allow_bucket_creation=True,
).create_dir(sys.argv[2])
"""


@dataclass(kw_only=True, slots=True)
class RayHosts:
    """Hosts with a Ray node each (``ray_hosts``) and, if asked for, an S3 host; ``close()`` removes it all."""

    hosts: Hosts
    #: The head's GCS address, ``<host 0's ip>:RAY_PORT``.
    address: str
    #: The hosts that run a Ray node (host 0 the head), and each one's ``ray start --block`` process.
    ray_hosts: list[Host]
    ray_procs: list[subprocess.Popen]
    #: The S3 host (no Ray) and its endpoint, or None.
    s3_host: Host | None = None
    s3: S3Endpoint | None = None
    #: The head's dashboard (``http://<host 0's ip>:DASHBOARD_PORT``, where ``ray job submit`` goes), or None.
    dashboard: str | None = None
    #: Each Ray node's CPUs and object store (MiB).
    num_cpus: int = 2
    object_store_mb: int = 80

    def __enter__(self) -> RayHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.ray_hosts[index]

    def __len__(self) -> int:
        return len(self.ray_hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.ray_hosts)

    def ray_nodes(self, want: int = 0, timeout: float = START_TIMEOUT_S) -> list[str]:
        """The addresses of Ray's alive nodes, sorted, as a driver on host 0 sees them.

        Args:
            want: Wait (up to ``timeout`` seconds) until at least this many nodes are alive.
            timeout: Seconds to wait for them.

        Returns:
            The alive nodes' IP addresses (fewer than ``want`` if they did not come up in time).

        Raises:
            RuntimeError: The driver on host 0 failed; the message has its output.
        """
        proc = self.ray_hosts[0].python(_NODES_SNIPPET, self.address, str(want), str(timeout), timeout=timeout + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"asking Ray for its nodes failed on host 0:\n{proc.stderr[-3000:]}")
        return proc.stdout.split()

    def start_node(self, index: int) -> None:
        """Start host ``index``'s Ray node again (after a crash, or once Ray took it for dead), joined to the head;
        return once Ray has it alive.

        Raises:
            RuntimeError: Its ``ray start`` exited, or Ray did not count it alive within ``START_TIMEOUT_S``.
        """
        host = self.ray_hosts[index]
        if index == 0:
            raise ValueError("host 0 is the head: a cluster whose head is gone is a new cluster")
        with open(_log_path(self.hosts, host), "a") as log:
            proc = host.popen(
                _node_command(self, host), graceful=True, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self.ray_procs[index] = proc
        deadline = time.monotonic() + START_TIMEOUT_S
        while host.ip not in self.ray_nodes(timeout=10):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {index}'s Ray node did not join again:\n{_log(self.hosts, host)}")

    def close(self) -> None:
        """``Hosts.close()``: every process of the hosts ended, every namespace and directory removed."""
        self.hosts.close()


#: What ``ray start`` says when a node's raylet did not register with the GCS within Ray's own bound (30 s,
#: which no setting changes): on a busy machine, a start that may well succeed when tried again.
RAYLET_TIMED_OUT = "The current node timed out during startup"
#: Whole tries of ``build_ray_hosts`` (each with new hosts) when a node's start timed out that way.
START_TRIES = 2


def build_ray_hosts(n: int, **options: Any) -> RayHosts:
    """``_build_ray_hosts(n, **options)``, tried again with new hosts when a node's raylet timed out
    registering (``RAYLET_TIMED_OUT``); every other failure is raised at once."""
    return tried(lambda: _build_ray_hosts(n, **options), START_TRIES)


def tried(build: Callable[[], T], tries: int) -> T:
    """``build()``, called up to ``tries`` times while it fails with ``RAYLET_TIMED_OUT`` in its message."""
    for attempt in range(1, tries + 1):
        try:
            return build()
        except RuntimeError as exc:
            if RAYLET_TIMED_OUT not in str(exc) or attempt == tries:
                raise
            print(f"ray_hosts: a node's raylet timed out registering (try {attempt} of {tries}); again", flush=True)
    raise AssertionError("unreachable")


def _build_ray_hosts(
    n: int,
    *,
    shm_mb: int = 256,
    num_cpus: int = 2,
    object_store_mb: int = 80,
    s3_bucket: str | None = None,
    env: Mapping[str, str] | None = None,
    dashboard: bool = False,
) -> RayHosts:
    """``n`` hosts (``build_hosts``) with a Ray node each, and with ``s3_bucket`` one more serving S3.

    Host 0 is the head. Returns once Ray has all ``n`` nodes alive (and S3 its bucket).
    If anything fails, everything made is removed before the error is raised.

    Args:
        n: How many Ray hosts.
        shm_mb: Size of each host's ``/dev/shm``, in MiB.
        num_cpus: Each Ray node's CPUs.
        object_store_mb: Each Ray node's object store, in MiB (within ``shm_mb``).
        s3_bucket: Add host ``n``, without Ray, running ``moto_server`` on ``<its ip>:S3_PORT``,
            with this bucket; every host then has ``S3_ENV`` in its environment.
        env: Added to the environment of every process on the hosts (Ray's included).
        dashboard: Start the head's dashboard on ``<host 0's ip>:DASHBOARD_PORT`` (for ``ray job submit``);
            returns once it answers.

    Returns:
        The ``RayHosts`` (a context manager; ``close()`` tears everything down).

    Raises:
        RuntimeError: A step failed, or Ray did not bring up all ``n`` nodes (or S3 did not
            serve) within ``START_TIMEOUT_S``; the message has the logs.
    """
    extra = S3_ENV if s3_bucket is not None else {}
    hosts = build_hosts(n + (s3_bucket is not None), shm_mb=shm_mb, env={**RAY_ENV, **extra, **(env or {})})
    try:
        s3_host = hosts[n] if s3_bucket is not None else None
        if s3_host is not None:  # it starts beside the Ray nodes
            log_path = f"{hosts.root}/s3.log"
            with open(log_path, "w") as log:
                s3_host.popen(
                    [sys.executable, "-m", "moto.server", "-H", s3_host.ip, "-p", str(S3_PORT)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        cluster = RayHosts(
            hosts=hosts,
            address=f"{hosts[0].ip}:{RAY_PORT}",
            ray_hosts=hosts.hosts[:n],
            ray_procs=[],
            num_cpus=num_cpus,
            object_store_mb=object_store_mb,
        )
        if dashboard:
            cluster.dashboard = f"http://{hosts[0].ip}:{DASHBOARD_PORT}"
        _start_ray(cluster)
        if s3_host is not None and s3_bucket is not None:
            cluster.s3_host = s3_host
            cluster.s3 = _serve_bucket(s3_host, s3_bucket, log_path)
    except BaseException:
        hosts.close()
        raise
    return cluster


def _start_ray(cluster: RayHosts) -> None:
    """``ray start --block`` on each of the cluster's hosts (the first the head); wait until Ray has them all alive."""
    hosts, on, head = cluster.hosts, cluster.ray_hosts, cluster.ray_hosts[0]
    for host in on:
        cmd = _node_command(cluster, host)
        with open(_log_path(hosts, host), "w") as log:
            proc = host.popen(cmd, graceful=True, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        cluster.ray_procs.append(proc)
        if host is head:  # the others join once the head's GCS answers
            deadline = time.monotonic() + START_TIMEOUT_S
            while not head.can_connect(head.ip, RAY_PORT, timeout=1.0):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Ray head did not listen on {cluster.address}:\n{_log(hosts, head)}")
    # One driver on host 0 waits for the nodes, while every node is watched: one that exits ends the wait.
    args = [cluster.address, str(len(on)), str(START_TIMEOUT_S)]
    with open(f"{hosts.root}/nodes.log", "w+") as err:
        waiter = head.popen([sys.executable, "-c", _NODES_SNIPPET, *args], stdout=subprocess.PIPE, stderr=err)
        while waiter.poll() is None and all(proc.poll() is None for proc in cluster.ray_procs):
            time.sleep(0.1)
        if waiter.poll() is None:
            waiter.kill()
        out = waiter.communicate()[0]
        err.seek(0)
        driver = err.read()[-2000:]
    for host, proc in zip(on, cluster.ray_procs):
        if proc.poll() is not None:
            why = f"status {proc.returncode}"
            raise RuntimeError(f"`ray start` exited on host {host.index} ({why}):\n{_log(hosts, host)}")
    alive = out.decode().split()
    if alive != sorted(host.ip for host in on):
        logs = "\n".join(_log(hosts, host) for host in on)
        raise RuntimeError(f"Ray has the nodes {alive}, not one on each host:\n{driver}\n{logs}")
    if cluster.dashboard and not head.can_connect(head.ip, DASHBOARD_PORT, timeout=START_TIMEOUT_S):
        raise RuntimeError(f"the Ray dashboard did not listen on {cluster.dashboard}:\n{_log(hosts, head)}")


def _node_command(cluster: RayHosts, host: Host) -> list[str]:
    """``ray start --block`` of ``host``'s node: the head on the cluster's first host, else joining it."""
    temp_dir = f"{cluster.hosts.root}/h{host.index}"  # short: Ray's socket paths must fit in 107 characters
    cmd = [f"{BIN}/ray", "start", "--block", "--node-ip-address", host.ip, "--num-cpus", str(cluster.num_cpus)]
    cmd += ["--object-store-memory", str(cluster.object_store_mb << 20), "--temp-dir", temp_dir]
    if host is not cluster.ray_hosts[0]:
        return [*cmd, "--address", cluster.address]
    cmd += ["--head", "--port", str(RAY_PORT)]
    if cluster.dashboard:
        return [*cmd, "--dashboard-host", host.ip, "--dashboard-port", str(DASHBOARD_PORT)]
    return [*cmd, "--include-dashboard", "false"]


def _serve_bucket(host: Host, bucket: str, log_path: str) -> S3Endpoint:
    """Wait until the S3 host serves, then create ``bucket`` there."""
    endpoint = S3Endpoint(f"{host.ip}:{S3_PORT}", bucket, log_path)
    made = None
    if host.can_connect(host.ip, S3_PORT, timeout=START_TIMEOUT_S):
        made = host.python(_BUCKET_SNIPPET, endpoint.host_port, bucket)
    if made is None or made.returncode != 0:
        with open(log_path) as f:
            why = made.stderr[-2000:] if made is not None else ""
            raise RuntimeError(f"the S3 host did not serve {bucket} at {endpoint.host_port}:\n{why}{f.read()[-3000:]}")
    return endpoint


def _log_path(hosts: Hosts, host: Host) -> str:
    return f"{hosts.root}/h{host.index}.ray.log"


def _log(hosts: Hosts, host: Host) -> str:
    try:
        with open(_log_path(hosts, host)) as f:
            return f"host {host.index}: {f.read()[-2000:]}"
    except OSError:
        return f"host {host.index}: no log"
