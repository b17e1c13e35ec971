"""Hosts on one machine: each a network namespace and a mount namespace, joined by a private switch.

For tests that need several machines (a node cut off, a node's ``/dev/shm`` or disk of
its own) on one. Each host has its own IPv4 address on a bridge that lives in a network
namespace of its own (the switch): nothing is added to the machine's own network, and
the hosts reach nothing but each other. Each host's processes see their own tmpfs at
``/dev/shm`` and their own local disk at ``Host.disk``. With ``own_pids`` each host also
has a PID namespace of its own: its processes see (``/proc``, ``ps``) and can signal only
each other, so a ``ray stop`` run there stops that host's Ray only. ``testbed.ray_hosts``
starts a Ray node on each.

Everything is torn down by ``Hosts.close()``: every process of the hosts is killed by its
process group, then by the namespace it runs in (never by name: other Ray clusters on
the machine are left alone), the namespaces are deleted and the temporary directory
removed. Building needs root; ``hosts_unavailable()`` says why it cannot be done here.
"""

from __future__ import annotations

import atexit
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

BIN = os.path.dirname(sys.executable)
#: The tools building hosts takes from PATH.
TOOLS = ("ip", "unshare", "nsenter", "mount", "sh", "sleep")
#: How long the processes started with ``graceful`` have to end on SIGTERM before everything is killed.
STOP_GRACE_S = 5.0

#: The first process of a host with a PID namespace of its own (its pid 1): it reaps the processes orphaned there.
_INIT = """
import os, time  # rayckpt host init
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(1)
"""

#: Run on a host: exit 0 once ``address:port`` accepts a TCP connection, 1 if it does not within the timeout.
_CONNECT_SNIPPET = """
import socket, sys, time
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())).close()
        sys.exit(0)
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.1)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip <args>``; raise with its stderr if it fails and ``check``."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def new_prefix() -> str:
    """A name prefix for one run's namespaces and directory: ``rk`` and six random hex digits."""
    return f"rk{secrets.token_hex(3)}"


def hosts_unavailable() -> str | None:
    """Why hosts cannot be built on this machine, or None if they can.

    Checks for root and the tools, then makes (and deletes) a probe namespace with a
    bridge, a veth pair and a tmpfs at ``/dev/shm`` in a mount namespace of its own.

    Returns:
        One line saying what is missing or what failed; None if everything worked.
    """
    if os.geteuid() != 0:
        return "building hosts needs root (network and mount namespaces)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"building hosts needs {', '.join(missing)} on PATH"
    probe = f"{new_prefix()}-probe"
    steps = [
        ["ip", "netns", "add", probe],
        ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
        ["ip", "netns", "exec", probe, "unshare", "--mount", "--propagation", "private"]
        + ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/dev/shm"],
    ]
    try:
        for step in steps:
            proc = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                return f"`{' '.join(step)}` failed: {proc.stderr.strip() or f'exit status {proc.returncode}'}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@dataclass(kw_only=True, slots=True)
class Host:
    """One host: its network namespace and address, its mount namespace (held by the process ``pid``), its disk.

    Commands run in both namespaces (``nsenter`` into ``pid``'s), so they see the
    host's ``/dev/shm`` and disk and reach the other hosts at their addresses.
    """

    index: int
    netns: str
    ip: str
    #: The switch's network namespace and the name of this host's port (its veth's end) there.
    switch: str
    port: str
    #: The host's local disk: the path its processes see, and the same directory seen from the machine.
    disk: str
    disk_outside: str
    #: Environment of every command run on the host (the caller's without RAY_ADDRESS, and ``env`` of
    #: ``build_hosts``).
    env: dict[str, str]
    #: The process holding the host's mount namespace (0 until started); with ``own_pids``, the host's pid 1.
    pid: int = 0
    #: The host has a PID namespace of its own (``build_hosts(own_pids=True)``).
    own_pids: bool = False
    #: Every process started on the host with ``popen`` (and the one holding it), each a session of its own.
    procs: list[subprocess.Popen] = field(default_factory=list)
    #: Those of ``procs`` that ``close()`` asks to end (SIGTERM) before it kills the rest.
    graceful: list[subprocess.Popen] = field(default_factory=list)

    def command(self, cmd: Sequence[str], cwd: str | None = None) -> list[str]:
        """``cmd`` wrapped to run in the host's namespaces, in ``cwd`` (default: this process's).

        With ``own_pids`` ``nsenter`` forks: the pid ``popen`` returns is ``nsenter``'s, ``cmd`` its child
        (in its process group).
        """
        enter = ["nsenter", f"--target={self.pid}", "--mount", "--net", *(["--pid"] if self.own_pids else [])]
        return [*enter, "sh", "-c", 'cd "$0" && exec "$@"', cwd or os.getcwd(), *cmd]

    def popen(
        self,
        cmd: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        graceful: bool = False,
        **kwargs: Any,
    ) -> subprocess.Popen:
        """Start ``cmd`` on the host, in a session (and process group) of its own, killed by ``close()``.

        Args:
            cmd: The program and its arguments.
            cwd: Its working directory (default: this process's).
            env: Added to the host's environment.
            graceful: ``close()`` sends it SIGTERM and gives it ``STOP_GRACE_S`` to end (and reap its
                children) before killing its process group.
            **kwargs: Passed to ``subprocess.Popen`` (``stdout``, ``stderr``, ``text``...).

        Returns:
            The started process (its pid is the command's own).
        """
        proc = subprocess.Popen(
            self.command(cmd, cwd), env={**self.env, **(env or {})}, start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        if graceful:
            self.graceful.append(proc)
        return proc

    def run(
        self,
        cmd: Sequence[str],
        *,
        timeout: float = 60.0,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` on the host to its end; its output captured as text.

        Args:
            cmd: The program and its arguments.
            timeout: Seconds before it is killed and ``subprocess.TimeoutExpired`` raised.
            cwd: Its working directory (default: this process's).
            env: Added to the host's environment.

        Returns:
            The finished process (``returncode``, ``stdout``, ``stderr``); a failure is not raised.
        """
        return subprocess.run(
            self.command(cmd, cwd),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def python(self, code: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``python -c code args...`` (this interpreter) on the host; see ``run``."""
        return self.run([sys.executable, "-c", code, *args], timeout=timeout)

    def can_connect(self, ip: str, port: int, timeout: float = 2.0) -> bool:
        """Whether a TCP connection from this host to ``ip:port`` succeeds within ``timeout`` seconds."""
        return self.python(_CONNECT_SNIPPET, ip, str(port), str(timeout), timeout=timeout + 30).returncode == 0

    def link_down(self) -> None:
        """Cut the host off: its port on the switch goes down (the host's own interface stays up)."""
        _ip("-n", self.switch, "link", "set", self.port, "down")

    def link_up(self) -> None:
        """Connect the host again: its port on the switch comes up."""
        _ip("-n", self.switch, "link", "set", self.port, "up")

    def crash(self, timeout: float = 30.0) -> None:
        """The host's power cut: every process running on it SIGKILLed at once (its mounts stay, as a disk does).

        Raises ``RuntimeError`` if some process of the host is still running after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while pids := self.running():
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {self.index}: processes {sorted(pids)} outlived SIGKILL")
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.05)
        for proc in self.procs:
            if proc.pid != self.pid:
                proc.poll()  # reap the ones started here

    def running(self) -> set[int]:
        """The pids of the processes running on the host (in its network namespace), but the ones holding it."""
        proc = _ip("netns", "pids", self.netns, check=False)
        holders = {self.pid, *(p.pid for p in self.procs[:1])}
        return {int(p) for p in proc.stdout.split() if p.isdigit() and int(p) not in holders}


@dataclass(kw_only=True, slots=True)
class Hosts:
    """Hosts built by ``build_hosts``, and everything made for them; ``close()`` (or ``with``) removes it all."""

    #: The run's name prefix: its namespaces are ``<prefix>-sw`` and ``<prefix>-h<i>``.
    prefix: str
    #: The run's directory (``/tmp/<prefix>``): the hosts' disks, Ray temp dirs and logs.
    root: str
    hosts: list[Host] = field(default_factory=list)
    #: Every network namespace made, in order (deleted in reverse).
    netns: list[str] = field(default_factory=list)
    closed: bool = False

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def pids(self) -> set[int]:
        """The pids of every process now running in the run's namespaces."""
        found: set[int] = set()
        for ns in self.netns:
            proc = _ip("netns", "pids", ns, check=False)
            found |= {int(p) for p in proc.stdout.split() if p.isdigit()}
        return found

    def close(self) -> None:
        """Kill every process of the hosts, delete their namespaces and the run's directory.

        Idempotent, and safe on hosts only partly built. Processes go by their process
        groups, then by the namespaces they run in; nothing is killed by name.
        """
        procs = [proc for host in self.hosts for proc in host.procs]
        # A process that reaps its children on SIGTERM (`ray start --block`) ends first: what a SIGKILL orphans
        # goes to the machine's init, which may not reap it.
        graceful = [proc for host in self.hosts for proc in host.graceful if proc.poll() is None]
        for proc in graceful:
            _signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in graceful:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            if proc.poll() is None:  # its pid (and group id) not reaped, so not reused: still this group's
                _signal(proc.pid, signal.SIGKILL, group=True)
        deadline = time.monotonic() + 30
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.05)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self.netns):
            _ip("netns", "del", ns, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        if not self.closed:
            self.closed = True
            atexit.unregister(self.close)


def _signal(pid: int, sig: signal.Signals, group: bool = False) -> None:
    """Send ``sig`` to ``pid`` (its process group if ``group``); one gone already is fine."""
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def build_hosts(
    n: int,
    *,
    shm_mb: int = 256,
    env: Mapping[str, str] | None = None,
    own_pids: bool = False,
) -> Hosts:
    """``n`` hosts on a private switch, each with its own ``/dev/shm`` and disk.

    Host ``i`` is the network namespace ``<prefix>-h<i>`` at ``10.213.<x>.<10 + i>``
    (``x`` random: each run's network is its own anyway), its interface ``eth0`` a veth
    whose other end is port ``h<i>`` of the bridge in ``<prefix>-sw``. If anything
    fails, whatever was made is removed before the error is raised.

    Args:
        n: How many hosts.
        shm_mb: Size of each host's ``/dev/shm`` (a tmpfs), in MiB.
        env: Added to the environment of every process on the hosts.
        own_pids: Give each host a PID namespace of its own, with ``/proc`` mounted for it; its pid 1
            reaps what is orphaned there. A SIGTERM ``close()`` sends to a ``graceful`` process reaches
            its ``nsenter`` only; the host's processes end with its pid 1.

    Returns:
        The ``Hosts`` (a context manager; ``close()`` tears everything down).

    Raises:
        RuntimeError: A step failed; the message says which, with its output.
    """
    prefix = new_prefix()
    root = f"/tmp/{prefix}"
    os.mkdir(root, 0o755)
    hosts = Hosts(prefix=prefix, root=root)
    atexit.register(hosts.close)
    try:
        base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        _build(hosts, n, shm_mb, base | dict(env or {}), own_pids)
    except BaseException:
        hosts.close()
        raise
    return hosts


def _build(hosts: Hosts, n: int, shm_mb: int, env: dict[str, str], own_pids: bool) -> None:
    """Make the switch and ``n`` hosts in ``hosts`` (recording each thing before it is made)."""
    switch = f"{hosts.prefix}-sw"
    hosts.netns.append(switch)
    _ip("netns", "add", switch)
    _ip("-n", switch, "link", "set", "lo", "up")
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    subnet = f"10.213.{random.randint(1, 254)}"
    env = {**env, "PATH": f"{BIN}:{env.get('PATH', '')}"}
    for i in range(n):
        disk = f"{hosts.root}/disk"  # the same path on every host, a different directory behind it
        host = Host(
            index=i,
            netns=f"{hosts.prefix}-h{i}",
            ip=f"{subnet}.{10 + i}",
            switch=switch,
            port=f"h{i}",
            disk=disk,
            disk_outside=f"{hosts.root}/d{i}",
            env=env,
            own_pids=own_pids,
        )
        hosts.hosts.append(host)
        hosts.netns.append(host.netns)
        _ip("netns", "add", host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _ip("-n", switch, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        os.makedirs(disk, exist_ok=True)
        os.mkdir(host.disk_outside)
        _start_holder(hosts, host, shm_mb)


def _start_holder(hosts: Hosts, host: Host, shm_mb: int) -> None:
    """Start the process that holds the host's mount namespace (its ``/dev/shm``, its disk) and wait for it."""
    shm = f"mount -t tmpfs -o size={shm_mb}m,mode=1777 tmpfs /dev/shm"
    mounts = f"{shm} && mount --bind {host.disk_outside} {host.disk}"
    cmd = ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--propagation", "private"]
    # ip netns exec, unshare and sh each exec the next: the holder is sleep once the mounts are made. With
    # own_pids unshare forks (and stays, its child killed with it): the holder is the child, the init.
    hold = "exec sleep infinity"
    if host.own_pids:
        cmd += ["--pid", "--fork", "--kill-child", "--mount-proc"]
        hold = f"exec {shlex.quote(sys.executable)} -c {shlex.quote(_INIT)}"
    log_path = f"{hosts.root}/h{host.index}.holder.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*cmd, "sh", "-c", f"{mounts} && {hold}"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    host.procs.append(proc)
    deadline = time.monotonic() + 30
    while not (holder := _holder(proc.pid, host.own_pids)):
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log_path) as f:
                raise RuntimeError(f"host {host.index}'s mounts failed:\n{f.read()[-3000:]}")
        time.sleep(0.01)
    host.pid = holder


def _holder(pid: int, own_pids: bool) -> int:
    """The pid of the holder started as ``pid`` once it holds the host's mounts (0 until then)."""
    if not own_pids:
        return pid if _read(f"/proc/{pid}/comm").strip() == "sleep" else 0
    for child in _read(f"/proc/{pid}/task/{pid}/children").split():
        if "rayckpt host init" in _read(f"/proc/{child}/cmdline"):
            return int(child)
    return 0


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
