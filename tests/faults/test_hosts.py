"""Hosts on one machine (``testbed.hosts``, ``ray_hosts``): three Ray nodes, each in its own network
and mount namespace, and an S3 host; a host's link cut and restored; nothing left once they are closed.

One set of hosts for the module. The tests run in file order: the last closes the hosts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import testbed.hosts as hosts_module
from testbed.hosts import build_hosts, hosts_unavailable
from testbed.ray_hosts import RAY_PORT, RayHosts, build_ray_hosts

pytestmark = pytest.mark.slow

#: Host 2 listens here (each host has its own network stack: any port is free).
PORT = 7000
SERVE = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    server.accept()[0].close()
"""
#: Run on host 0: a task on each host given (by address), and an object made on the last one read on the first.
ON_EACH = """
import sys, ray, numpy as np
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
ips = sys.argv[2:]

@ray.remote(num_cpus=0)
def where():
    return ray.util.get_node_ip_address()

@ray.remote(num_cpus=0)
def make():
    return np.arange(4 << 20, dtype=np.uint8)

@ray.remote(num_cpus=0)
def total(a):
    return int(a.sum(dtype=np.int64)), ray.util.get_node_ip_address()

print(*ray.get([where.options(resources={f"node:{ip}": 0.01}).remote() for ip in ips]))
made = make.options(resources={f"node:{ips[-1]}": 0.01}).remote()
print(*ray.get(total.options(resources={f"node:{ips[0]}": 0.01}).remote(made)))
"""
#: Run on a host: write ``argv[3]`` to the object ``argv[2]`` at the S3 endpoint ``argv[1]``, or print it if no
#: ``argv[3]``.
S3_OBJECT = """
import sys
from rayckpt.testing.s3_server import S3Endpoint
endpoint = S3Endpoint(sys.argv[1], "hosts", "")
path, fs = endpoint.fs_path(sys.argv[2]), endpoint.filesystem()
if len(sys.argv) > 3:
    with fs.open_output_stream(path) as f:
        f.write(sys.argv[3].encode())
else:
    with fs.open_input_stream(path) as f:
        print(f.read().decode())
"""


@pytest.fixture(scope="module")
def hosts():
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with build_ray_hosts(3, shm_mb=128, s3_bucket="hosts") as built:
        yield built


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_three_ray_hosts_with_their_own_addresses_shm_and_disks(hosts: RayHosts):
    ips = [host.ip for host in hosts]
    assert len(set(ips)) == 3
    assert hosts.ray_nodes() == sorted(ips)
    for host in hosts:
        addresses = host.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
        assert f"inet {host.ip}/24" in addresses

    name = f"{hosts.hosts.prefix}-probe"
    wrote = hosts[1].run(["sh", "-c", f"echo one > /dev/shm/{name} && echo one > {hosts[1].disk}/{name}"])
    assert wrote.returncode == 0, wrote.stderr
    assert hosts[1].run(["cat", f"/dev/shm/{name}"]).stdout == "one\n"
    assert hosts[2].run(["test", "-e", f"/dev/shm/{name}"]).returncode == 1
    assert not os.path.exists(f"/dev/shm/{name}")
    # Each host's disk is one path on every host, a directory of its own behind it.
    assert hosts[1].disk == hosts[2].disk
    assert hosts[2].run(["test", "-e", f"{hosts[2].disk}/{name}"]).returncode == 1
    assert os.listdir(hosts[1].disk_outside) == [name]
    assert os.listdir(hosts[2].disk_outside) == []


def test_ray_runs_a_task_on_each_host_and_moves_an_object_between_them(hosts: RayHosts):
    ips = [host.ip for host in hosts]
    ran = hosts[0].python(ON_EACH, hosts.address, *ips, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    where, moved = ran.stdout.splitlines()
    assert where.split() == ips
    expected = int(sum(range(256)) * ((4 << 20) // 256))
    assert moved.split() == [str(expected), ips[0]]


def test_the_s3_host_serves_every_host(hosts: RayHosts):
    assert hosts.s3 is not None and hosts.s3_host is not None
    assert hosts.s3_host.ip not in hosts.ray_nodes()
    wrote = hosts[1].python(S3_OBJECT, hosts.s3.host_port, "from-1", "written on host 1")
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    read = hosts[2].python(S3_OBJECT, hosts.s3.host_port, "from-1")
    assert read.stdout == "written on host 1\n", read.stderr[-3000:]


def test_a_host_cut_off_and_connected_again(hosts: RayHosts):
    hosts[2].popen([sys.executable, "-c", SERVE, hosts[2].ip, str(PORT)])
    assert hosts[1].can_connect(hosts[2].ip, PORT, timeout=30)
    hosts[2].link_down()
    try:
        assert not hosts[1].can_connect(hosts[2].ip, PORT, timeout=2)
        assert hosts[1].can_connect(hosts[0].ip, RAY_PORT, timeout=10)  # the others still reach each other
    finally:
        hosts[2].link_up()
    assert hosts[1].can_connect(hosts[2].ip, PORT, timeout=10)


def test_closing_leaves_nothing(hosts: RayHosts):
    every = hosts.hosts
    pids = every.pids() | {proc.pid for host in every for proc in host.procs}
    assert {host.pid for host in every} | {proc.pid for proc in hosts.ray_procs} < pids
    hosts.close()
    assert [name for name in netns_names() if name.startswith(every.prefix)] == []
    assert [pid for pid in pids if running(pid)] == []
    assert not os.path.exists(every.root)
    hosts.close()  # a second time: nothing to do, nothing raised


@pytest.fixture
def prefixes(monkeypatch) -> list[str]:
    """The name prefix of every set of hosts built in the test (namespaces and ``/tmp/<prefix>``)."""
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    made: list[str] = []
    original = hosts_module.new_prefix

    def new_prefix() -> str:
        made.append(original())
        return made[-1]

    monkeypatch.setattr(hosts_module, "new_prefix", new_prefix)
    return made


def left_of(prefixes: list[str]) -> list[str]:
    """The namespaces and directories of ``prefixes`` still there."""
    dirs = [f"/tmp/{prefix}" for prefix in prefixes if os.path.exists(f"/tmp/{prefix}")]
    return dirs + [name for name in netns_names() if name.startswith(tuple(prefixes))]


def test_a_build_that_fails_half_way_leaves_nothing(prefixes: list[str]):
    with pytest.raises(RuntimeError, match="mounts failed"):
        build_hosts(2, shm_mb=-1)  # the switch and host 0's namespace made, its tmpfs refused
    assert len(prefixes) == 1 and left_of(prefixes) == []


def test_a_ray_node_that_fails_to_start_leaves_nothing(prefixes: list[str]):
    with pytest.raises(RuntimeError, match="`ray start` exited on host 0"):
        build_ray_hosts(2, object_store_mb=1)  # below Ray's smallest object store: `ray start` exits
    assert len(prefixes) == 1 and left_of(prefixes) == []
