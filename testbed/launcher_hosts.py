"""Hosts for Ray's cluster launcher: ``ray up`` with the local node provider, over SSH, on one machine.

``build_launcher_hosts(n)`` builds ``n + 1`` hosts (``testbed.hosts``), each with a
PID namespace of its own: hosts ``0..n-1`` are the cluster's machines (``sshd`` on each,
listening on the host's address only), host ``n`` is the user's machine, where ``ray up``,
``ray job submit`` and ``ray down`` run (``LauncherHosts.ray``). Every host has its own
``/root`` and ``/home`` (directories of its disk mounted there), so what Ray copies to a
node's home lands on that node; its ``~/.bashrc`` gives the node's environment (the venv on
``PATH``, a Ray temp dir of its own, the object store capped to fit its ``/dev/shm``), as a
machine image would. A node's ``ray stop`` sees only that host's processes
(``foreign_processes`` checks it before anything may run one).

``local_cluster_config`` turns ``cluster.yaml`` (the AWS config) into the local provider's:
only the keys a cloud decides, or that need the internet, are replaced.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from testbed.hosts import BIN, Host, Hosts, build_hosts, hosts_unavailable

SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
#: What the launcher and the nodes run besides what building hosts needs.
TOOLS = ("ssh", "ssh-keygen", "rsync")
#: The keys of ``cluster.yaml`` that ``local_cluster_config`` replaces or drops (the rest is kept as shipped).
REPLACED = ("provider", "auth", "available_node_types", "head_node_type", "setup_commands")
START_TIMEOUT_S = 60.0
#: The launcher's environment. Autoscaler v2 (``ray up``'s default since Ray 2.50) counts the head toward the
#: workers' ``min_workers`` under the local provider (head and workers are its one node type) and starts one
#: worker fewer than asked; v1 starts them all.
LAUNCHER_ENV = {"RAY_UP_enable_autoscaler_v2": "0"}

#: Run on a host: print every process it can see (``/proc``, as ``ps`` and ``ray stop`` read it) that is not
#: in its own PID namespace, one a line.
_FOREIGN_SNIPPET = """
import os
own = os.readlink("/proc/self/ns/pid")
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if os.readlink(f"/proc/{pid}/ns/pid") != own:
            print(pid, open(f"/proc/{pid}/cmdline").read().replace(chr(0), " ")[:200])
    except OSError:
        pass
"""
#: Run on the launcher: wait until the cluster whose dashboard is ``argv[1]`` has ``argv[2]`` alive nodes, then
#: print their addresses, one a line.
_NODES_SNIPPET = """
import sys, time
from ray.util.state import list_nodes
address, want, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
alive = []
while len(alive) < want and time.monotonic() < deadline:
    try:
        alive = sorted(n.node_ip for n in list_nodes(address=address, filters=[("state", "=", "ALIVE")]))
    except Exception:
        pass
    time.sleep(1)
print("\\n".join(alive))
"""


def launcher_unavailable() -> str | None:
    """Why ``build_launcher_hosts`` cannot run here (hosts, or ``sshd`` / ``rsync`` missing), or None."""
    reason = hosts_unavailable()
    if reason is not None:
        return reason
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    missing += [] if os.access(SSHD, os.X_OK) else [SSHD]
    if missing:
        return f"ray up on hosts needs {', '.join(missing)}: run scripts/install_host_tools.sh (as root)"
    return None


def local_cluster_config(
    shipped: Mapping[str, Any],
    *,
    head_ip: str,
    worker_ips: list[str],
    ssh_user: str,
    ssh_private_key: str,
) -> dict[str, Any]:
    """``cluster.yaml``'s config for Ray's local node provider on the machines ``head_ip`` and ``worker_ips``.

    Replaced (``REPLACED``): ``provider`` (``type: local`` and the machines' addresses, for the cloud's
    region and zones); ``auth`` (``ssh_user`` and its key, where the cloud makes a key pair);
    ``available_node_types`` and ``head_node_type`` dropped (instance types and images are the cloud's; the
    local provider makes one node type of its own and refuses others, so the head's resources are those
    Ray detects); ``setup_commands`` (pip installs from the internet) become one command per node that
    checks what they would have installed: the pinned torch and Ray versions, and the package importable
    from the file mount's copy of the working tree. Everything else, the start commands (``ray stop``
    first) and the file mounts included, is kept as shipped.

    Args:
        shipped: ``cluster.yaml`` as loaded.
        head_ip: The head's address.
        worker_ips: The worker nodes' addresses.
        ssh_user: The user the launcher logs in as on every node.
        ssh_private_key: Its key, on the launcher.

    Returns:
        The config for ``ray up`` (a new dict; ``shipped`` is not changed).
    """
    config = {key: value for key, value in shipped.items() if key not in REPLACED}
    config["provider"] = {"type": "local", "head_ip": head_ip, "worker_ips": list(worker_ips)}
    config["auth"] = {"ssh_user": ssh_user, "ssh_private_key": ssh_private_key}
    setup = " ".join(shipped.get("setup_commands", []))
    torch_pin = re.search(r"torch==([\w.]+)", setup)
    ray_pin = re.search(r"ray\[[^\]]*\]==([\w.]+)", setup)
    if torch_pin is None or ray_pin is None:
        raise ValueError(f"no torch== and ray[...]== pins in the setup_commands of the shipped config: {setup!r}")
    check = (
        "import torch, ray, rayckpt; "
        f"assert torch.__version__.split('+')[0] == {torch_pin[1]!r}, torch.__version__; "
        f"assert ray.__version__ == {ray_pin[1]!r}, ray.__version__"
    )
    tree = next(iter(shipped.get("file_mounts", {})), "~")
    config["setup_commands"] = [f"cd {tree} && python3 -c {shlex.quote(check)}"]
    return config


@dataclass(kw_only=True, slots=True)
class LauncherHosts:
    """The nodes (``sshd`` on each; host 0 the head) and the launcher host; ``close()`` removes everything."""

    hosts: Hosts
    nodes: list[Host]
    launcher: Host
    #: The launcher's private key (its public key is authorized on every node, for ``ssh_user``).
    ssh_private_key: str
    ssh_user: str

    def __enter__(self) -> LauncherHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ray(
        self,
        *args: str,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 600.0,
    ) -> subprocess.CompletedProcess[str]:
        """``ray args...`` (the CLI) on the launcher host, to its end, ``env`` added; its output captured."""
        return self.launcher.run([f"{BIN}/ray", *args], cwd=cwd, env=env, timeout=timeout)

    def alive_nodes(self, dashboard: str, want: int, timeout: float) -> list[str]:
        """The addresses of the cluster's alive nodes, as its dashboard ``dashboard`` reports them, once there are
        ``want`` (or ``timeout`` seconds passed)."""
        args = [dashboard, str(want), str(timeout)]
        proc = self.launcher.python(_NODES_SNIPPET, *args, timeout=timeout + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"asking the dashboard for the nodes failed:\n{proc.stderr[-3000:]}")
        return proc.stdout.split()

    def close(self) -> None:
        """``Hosts.close()``: every process of the hosts ended, every namespace and directory removed."""
        self.hosts.close()


def foreign_processes(host: Host) -> list[str]:
    """The processes ``host`` can see that are not its own (pid and command line each): none where its ``ray stop``
    may run. Raises ``RuntimeError`` if the check itself fails."""
    proc = host.python(_FOREIGN_SNIPPET, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"listing host {host.index}'s processes failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.splitlines()


def build_launcher_hosts(
    n: int,
    *,
    shm_mb: int = 256,
    object_store_mb: int = 100,
    env: Mapping[str, str] | None = None,
) -> LauncherHosts:
    """``n`` nodes with ``sshd`` and a launcher host, each with a PID namespace and a home of its own.

    Args:
        n: How many nodes (the cluster's machines).
        shm_mb: Size of each host's ``/dev/shm``, in MiB.
        object_store_mb: The cap on each node's object store (``RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES``
            in its ``~/.bashrc``), within ``shm_mb``: Ray's default is a share of the machine's memory.
        env: Set in every host's environment and in each node's ``~/.bashrc`` (what a Ray node started over
            SSH inherits).

    Returns:
        The ``LauncherHosts`` (a context manager; ``close()`` tears everything down).

    Raises:
        RuntimeError: A step failed, or a host sees processes not its own; the message says which.
    """
    hosts = build_hosts(n + 1, shm_mb=shm_mb, env=env, own_pids=True)
    try:
        keys = f"{hosts.root}/ssh"
        os.mkdir(keys, 0o700)
        for name in ("host_key", "id_ed25519"):
            _check(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", hosts.prefix, "-f", f"{keys}/{name}"])
        shutil.copy(f"{keys}/id_ed25519.pub", f"{keys}/authorized_keys")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        user = pwd.getpwuid(os.geteuid())
        node_env = {**(env or {}), "RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES": str(object_store_mb << 20)}
        for host in hosts.hosts:
            _own_home(host, user.pw_dir, node_env)
            foreign = foreign_processes(host)
            if foreign:
                raise RuntimeError(f"host {host.index} sees processes not its own:\n" + "\n".join(foreign[:20]))
        cluster = LauncherHosts(
            hosts=hosts,
            nodes=hosts.hosts[:n],
            launcher=hosts[n],
            ssh_private_key=f"{keys}/id_ed25519",
            ssh_user=user.pw_name,
        )
        cluster.launcher.env = {**cluster.launcher.env, **LAUNCHER_ENV}
        for host in cluster.nodes:
            _start_sshd(hosts, host, keys)
        for host in cluster.nodes:
            if not cluster.launcher.can_connect(host.ip, SSH_PORT, timeout=START_TIMEOUT_S):
                with open(f"{hosts.root}/h{host.index}.sshd.log") as f:
                    raise RuntimeError(f"sshd did not listen on {host.ip}:{SSH_PORT}:\n{f.read()[-3000:]}")
    except BaseException:
        hosts.close()
        raise
    return cluster


def _own_home(host: Host, home: str, env: Mapping[str, str]) -> None:
    """Give ``host`` what a machine of its own has: a home at ``home`` (an overlay on the machine's: what the host
    writes there goes to its disk) with its ``~/.bashrc``, a ``/home`` (a directory of its disk), and an
    ``/etc/hosts`` where the hostname is the host's address (Ray takes a node's address from it: the hosts
    share the machine's hostname, and no route out to ask otherwise)."""
    outside, disk = host.disk_outside, host.disk
    for name in ("upper", "work", "homes", "tmp"):
        os.makedirs(f"{outside}/{name}")
    lines = [f"export PATH={shlex.quote(BIN)}:$PATH", f"export RAY_TMPDIR={disk}/tmp"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
    with open(f"{outside}/upper/.bashrc", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(f"{outside}/hosts", "w") as f:
        f.write(f"127.0.0.1 localhost\n{host.ip} {socket.gethostname()}\n")
    overlay = f"lowerdir={home},upperdir={disk}/upper,workdir={disk}/work"
    mounts = [["-t", "overlay", "-o", overlay, "overlay", home], ["--bind", f"{disk}/homes", "/home"]]
    for mount in [*mounts, ["--bind", f"{disk}/hosts", "/etc/hosts"]]:
        proc = host.run(["mount", *mount])
        if proc.returncode != 0:
            raise RuntimeError(f"host {host.index}: mount {' '.join(mount)} failed: {proc.stderr.strip()}")
    host.env = {**host.env, "RAY_TMPDIR": f"{disk}/tmp", "HOME": home}


def _start_sshd(hosts: Hosts, host: Host, keys: str) -> None:
    """``sshd`` on ``host``, listening on its address only; key login only, to the keys in ``keys``."""
    config = f"{hosts.root}/h{host.index}.sshd_config"
    with open(config, "w") as f:
        f.write(
            f"ListenAddress {host.ip}:{SSH_PORT}\n"
            f"HostKey {keys}/host_key\n"
            f"PidFile {hosts.root}/h{host.index}.sshd.pid\n"
            f"AuthorizedKeysFile {keys}/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            # The keys live in the run's directory under /tmp (world-writable): StrictModes would refuse them.
            "UsePAM no\nStrictModes no\nUseDNS no\nPrintMotd no\nPrintLastLog no\n"
        )
    with open(f"{hosts.root}/h{host.index}.sshd.log", "w") as log:
        host.popen([SSHD, "-D", "-e", "-f", config], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


def _check(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
