"""Hosts on one machine (``testbed.hosts``, ``testbed.ray_hosts``): three Ray nodes, each in its own network and
mount namespace, and an S3 host; the hosts themselves, and ``ray job submit -- python jobs/train.py`` from host 0
across them, as a user submits it.

- The hosts: each Ray node at its own address with its own ``/dev/shm`` and disk; tasks and objects cross hosts;
  the S3 host serves every host; a host's link cut and restored; nothing left once they are closed, nor of a
  build that fails half way.
- The job with three workers, one per host: it saves to S3 and to the memory tier, whose replicas cross hosts
  over the writers' replica link; the run resumes with two workers; node-local storage is refused before
  training when the nodes run on several hosts.
- The same job when a host's resources fail the memory tier. One host's ``/dev/shm`` filled by another process,
  leaving Ray's object store its room: that node's memory tier has no room, so memory saves go to storage with
  one WARNING naming the node and why; the node's ranks stage through the object store; every storage
  checkpoint commits. The replica link to one host blocked by a firewall rule while Ray still reaches it: the
  replicas for that host go through Ray's object store, with one WARNING for it in the sending ShardWriter's log
  (a writer warns once per peer in its life: no other test blocks a link); the job and its memory saves commit.

One set of hosts for the module, closed by the last test that uses it (which checks that nothing is left). The
tests run in file order: the resume continues the first job's run; the jobs run before the faults, the link cut
last before the close. Each job has a run name and an S3 prefix of its own. A test that changes a host (a file
in its ``/dev/shm`` or on its disk, a firewall rule, its link) undoes it before the next test, whatever happened.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

import testbed.hosts as hosts_module
from rayckpt.storage.catalog import checkpoint_dir_name
from testbed.hosts import Host, build_hosts, hosts_unavailable
from testbed.ray_hosts import RAY_PORT, RayHosts, build_ray_hosts
from tests.helpers.host_jobs import ONE_PER_HOST, catalog, s3_puts, submit, summary, writers
from tests.helpers.ray_head import TINY

pytestmark = pytest.mark.slow

#: Each host's ``/dev/shm`` and each Ray node's object store in it (MiB).
SHM_MB = 256
OBJECT_STORE_MB = 80
#: Host 2 listens here (each host has its own network stack: any port is free).
PORT = 7000
#: The run of the job that resumes.
RUN = "hostjob"
#: Where the filler of a host's ``/dev/shm`` goes (the other process that fills it).
FILLER = "/dev/shm/filler"
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
#: Run on a host: write ``argv[4]`` to the object ``argv[3]`` of the bucket ``argv[2]`` at the S3 endpoint
#: ``argv[1]``, or print it if no ``argv[4]``.
S3_OBJECT = """
import sys
from rayckpt.testing.s3_server import S3Endpoint
endpoint = S3Endpoint(sys.argv[1], sys.argv[2], "")
path, fs = endpoint.fs_path(sys.argv[3]), endpoint.filesystem()
if len(sys.argv) > 4:
    with fs.open_output_stream(path) as f:
        f.write(sys.argv[4].encode())
else:
    with fs.open_input_stream(path) as f:
        print(f.read().decode())
"""

Undo = list[Callable[[], None]]


@pytest.fixture(scope="module")
def hosts() -> Iterator[RayHosts]:
    """Three Ray hosts (host 0 the head, with the dashboard ``ray job submit`` goes to) and an S3 host."""
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with build_ray_hosts(3, shm_mb=SHM_MB, object_store_mb=OBJECT_STORE_MB, s3_bucket="hosts", dashboard=True) as built:
        yield built


@pytest.fixture
def undo() -> Iterator[Undo]:
    """Steps that undo what the test changed on the hosts: run after it, newest first, whatever happened."""
    steps: Undo = []
    yield steps
    undo_all(steps)


def undo_all(steps: Undo) -> None:
    """Run ``steps`` newest first, each even if one before it failed, and forget them; raise the first failure."""
    failure: BaseException | None = None
    while steps:
        try:
            steps.pop()()
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def remove(host: Host, *paths: str) -> None:
    """Remove ``paths`` on ``host`` (those that are there)."""
    proc = host.run(["rm", "-f", *paths])
    assert proc.returncode == 0, f"removing {paths} on host {host.index} failed: {proc.stderr}"


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


def test_three_ray_hosts_with_their_own_addresses_shm_and_disks(hosts: RayHosts, undo: Undo):
    ips = [host.ip for host in hosts]
    assert len(set(ips)) == 3
    assert hosts.ray_nodes() == sorted(ips)
    for host in hosts:
        addresses = host.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
        assert f"inet {host.ip}/24" in addresses

    name = f"{hosts.hosts.prefix}-probe"
    undo.append(lambda: remove(hosts[1], f"/dev/shm/{name}", f"{hosts[1].disk}/{name}"))
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
    s3 = [hosts.s3.host_port, hosts.s3.bucket]
    wrote = hosts[1].python(S3_OBJECT, *s3, "from-1", "written on host 1")
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    read = hosts[2].python(S3_OBJECT, *s3, "from-1")
    assert read.stdout == "written on host 1\n", read.stderr[-3000:]


def test_three_workers_on_three_hosts_save_to_s3_and_replicate_memory_across_hosts(hosts: RayHosts):
    assert hosts.s3 is not None
    uri = hosts.s3.uri("runs")
    flags = ["--run-name", RUN, "--storage-path", uri, *ONE_PER_HOST, *TINY]
    proc = submit(hosts, "--num-workers", "3", "--steps", "8", "--checkpoint-every", "4", "--memory-every", "2", *flags)
    first = summary(proc)
    assert first["final_step"] == 8 and first["num_workers"] == 3 and first["resumed_from"] is None, first
    assert first["last_checkpoint"] == hosts.s3.fs_path(f"runs/{RUN}/{checkpoint_dir_name(8)}")
    assert catalog(hosts[1], uri) == [(RUN, 4, "committed", 3), (RUN, 8, "committed", 3)]

    found = writers(hosts)
    ips = sorted(host.ip for host in hosts)
    assert sorted(found) == ips, found
    # One rank per host: each host's writer wrote the share of one rank, a different one on each.
    ranks = {ip: {rank for run, rank in found[ip]["ranks"] if run == RUN} for ip in ips}
    assert sorted(r for got in ranks.values() for r in got) == [0, 1, 2] and all(len(r) == 1 for r in ranks.values())
    # The memory saves (steps 2 and 6) held each host's share on a peer host too: every host's writer received
    # replicas over the replica link, from a writer on another host (one writer per host; no job ran before).
    received = {ip: found[ip]["received"] for ip in ips}
    assert all(got["files"] > 0 and got["bytes"] > 0 for got in received.values()), received


def test_the_run_resumes_with_two_workers(hosts: RayHosts):
    assert hosts.s3 is not None
    uri = hosts.s3.uri("runs")
    flags = ["--run-name", RUN, "--storage-path", uri, *ONE_PER_HOST, *TINY]
    proc = submit(hosts, "--num-workers", "2", "--steps", "10", "--checkpoint-every", "4", "--resume", *flags)
    second = summary(proc)
    assert second["resumed_from"] == 8 and second["num_workers"] == 2 and second["final_step"] == 10, second
    assert "on 2 rank(s), resumed from step 8" in proc.stdout + proc.stderr
    # The first job released its memory checkpoints at its end: the resume reads step 8 from S3.
    assert second["restored_tier"] == "storage", second
    assert catalog(hosts[2], uri) == [(RUN, 4, "committed", 3), (RUN, 8, "committed", 3), (RUN, 10, "committed", 2)]


def test_node_local_storage_is_refused_before_training_when_the_nodes_are_on_several_hosts(hosts: RayHosts):
    assert hosts.s3 is not None
    storage = f"{hosts[0].disk}/local"  # each host has its own directory at this path
    puts = s3_puts(hosts.s3.log_path)
    flags = ["--run-name", "nodelocal", "--storage-path", storage, *ONE_PER_HOST, *TINY]
    proc = submit(hosts, "--num-workers", "2", "--steps", "2", "--checkpoint-every", "1", *flags)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    machines = ", ".join(sorted(host.ip for host in hosts))
    refused = (
        f"error: --storage-path {storage} is a local path, but the Ray cluster's nodes run on 3 machines "
        f"({machines}) and every node must reach the same files: use s3://... or gs://..., or an NFS path "
        "mounted on every node with RAYCKPT_LOCAL_IS_SHARED=1"
    )
    assert refused in output, output[-6000:]
    # Refused before Ray Train started: nothing on any host's disk, nothing written to S3.
    files = {host.index: disk_files(host) for host in hosts.hosts.hosts}
    assert files == {0: [], 1: [], 2: [], 3: []}, files
    assert s3_puts(hosts.s3.log_path) == puts


def memory_job(hosts: RayHosts, run: str, prefix: str) -> tuple[str, str]:
    """The job as ``run`` for 3 steps, three workers one per host, a memory save every step and a storage save at
    the last, under ``prefix`` on the S3 host: the storage URI and the job's output, once it ended at step 3."""
    assert hosts.s3 is not None
    uri = hosts.s3.uri(prefix)
    flags = ["--run-name", run, "--storage-path", uri, "--num-workers", "3", *ONE_PER_HOST, *TINY]
    proc = submit(hosts, "--steps", "3", "--checkpoint-every", "3", "--memory-every", "1", *flags)
    done = summary(proc)
    assert done["final_step"] == 3, done
    return uri, proc.stdout + proc.stderr


def test_a_host_whose_shm_another_process_filled_sends_memory_saves_to_storage_with_one_warning(
    hosts: RayHosts, undo: Undo
):
    full = hosts[1]
    free = shm_free(full)
    # Leave Ray's object store its room (its pages are taken only as objects are made), and no more.
    undo.append(lambda: remove(full, FILLER))
    filled = full.run(["fallocate", "-l", str(free - (OBJECT_STORE_MB << 20)), FILLER])
    assert filled.returncode == 0, f"filling /dev/shm of host {full.index} failed: {filled.stderr}"
    assert shm_free(full) <= OBJECT_STORE_MB << 20

    uri, output = memory_job(hosts, "shmfull", "shm")
    assert "(memory) committed step" not in output, output[-6000:]
    # Every memory save went to storage instead: each step is a storage checkpoint.
    assert committed(hosts[0], uri) == [("shmfull", step, "committed") for step in (1, 2, 3)]
    node = writers(hosts)[full.ip]["node"]
    warned = [line for line in output.splitlines() if "goes to storage, not memory" in line]
    assert len(warned) == 1, warned
    why = f"step 1 goes to storage, not memory: node {node} has 0 bytes free in /dev/shm"
    assert why in warned[0] and "its free space less Ray's object store" in warned[0], warned

    # Its rank staged through Ray's object store (which had its room); the others in their /dev/shm.
    staging = {ip: {how for run, how in found["staging"] if run == "shmfull"} for ip, found in writers(hosts).items()}
    assert staging[full.ip] == {"object_store"}, staging
    assert all(staging[host.ip] == {"shm"} for host in (hosts[0], hosts[2])), staging

    undo_all(undo)
    assert full.run(["ls", "/dev/shm"]).stdout.split() == [], f"/dev/shm of host {full.index} is not empty"


def test_replicas_to_a_host_whose_link_is_firewalled_go_through_ray_with_one_warning(hosts: RayHosts, undo: Undo):
    before = writers(hosts)  # made now if not yet: each listens on a port of its own from here on
    blocked = hosts[2]
    port, node = before[blocked.ip]["port"], before[blocked.ip]["node"]
    for host in (hosts[0], hosts[1]):
        ip_rule(host, "add", blocked.ip, port)
        undo.append(lambda host=host: ip_rule(host, "del", blocked.ip, port))
    assert not hosts[0].can_connect(blocked.ip, port) and not hosts[1].can_connect(blocked.ip, port)
    assert hosts.ray_nodes() == sorted(host.ip for host in hosts), "Ray lost a node behind the rule"

    uri, output = memory_job(hosts, "firewalled", "link")
    # The first memory save is never skipped (no save before it is unwritten); a later one may be.
    assert "firewalled (memory) committed step 1" in output, output[-6000:]
    assert committed(hosts[1], uri) == [("firewalled", 3, "committed")]

    after = writers(hosts)
    assert after[blocked.ip]["received"] == before[blocked.ip]["received"], after
    assert after[blocked.ip]["through_ray"]["files"] > 0 and after[blocked.ip]["through_ray"]["bytes"] > 0, after
    others = [host.ip for host in (hosts[0], hosts[1])]
    assert all(after[ip]["received"]["files"] > before[ip]["received"]["files"] for ip in others), after
    assert all(after[ip]["through_ray"] == {"files": 0, "bytes": 0} for ip in others), after
    # The sending ShardWriter warned once. It outlives jobs (made by a job before, or by `writers`): Ray sends a
    # detached actor's log lines to the job that made it, so they are in its log on its host, not in this job's
    # output.
    warned = sender_logs(hosts)
    assert len(warned) == 1, warned
    assert f"cannot reach the replica listener at {blocked.ip}:{port}" in warned[0], warned
    assert f"replicas to node {node} go through Ray instead" in warned[0], warned

    undo_all(undo)
    assert hosts[0].can_connect(blocked.ip, port), f"host 0 still cannot reach {blocked.ip}:{port}"


def test_a_host_cut_off_and_connected_again(hosts: RayHosts, undo: Undo):
    hosts[2].popen([sys.executable, "-c", SERVE, hosts[2].ip, str(PORT)])
    assert hosts[1].can_connect(hosts[2].ip, PORT, timeout=30)
    undo.append(hosts[2].link_up)
    hosts[2].link_down()
    assert not hosts[1].can_connect(hosts[2].ip, PORT, timeout=2)
    assert hosts[1].can_connect(hosts[0].ip, RAY_PORT, timeout=10)  # the others still reach each other
    undo_all(undo)
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


def committed(host: Host, uri: str) -> list[tuple]:
    """(run, step, status) of each checkpoint at ``uri`` (``rayckpt ls`` on ``host``)."""
    return [entry[:3] for entry in catalog(host, uri)]


def disk_files(host: Host) -> list[str]:
    """Every file on ``host``'s disk, relative to it."""
    found = []
    for dirpath, _, filenames in os.walk(host.disk_outside):
        found += [os.path.relpath(os.path.join(dirpath, name), host.disk_outside) for name in filenames]
    return sorted(found)


def ip_rule(host: Host, verb: str, peer: str, port: int) -> None:
    """Add (or delete) the rule in ``host``'s network that refuses its TCP connections to ``peer:port``."""
    cmd = ["ip", "-n", host.netns, "rule", verb, "to", peer, "ipproto", "tcp", "dport", str(port), "prohibit"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"`{' '.join(cmd)}` failed on host {host.index}: {proc.stderr.strip()}"


def sender_logs(hosts: RayHosts) -> list[str]:
    """The replica link's WARNING lines in every Ray worker log of the hosts (where a writer's logs are kept)."""
    proc = subprocess.run(
        ["grep", "-rh", "go through Ray instead", hosts.hosts.root, "--include=worker-*"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.stdout.splitlines()


def shm_free(host: Host) -> int:
    """Bytes free in ``host``'s ``/dev/shm``."""
    proc = host.python("import os; st = os.statvfs('/dev/shm'); print(st.f_bavail * st.f_frsize)")
    assert proc.returncode == 0, f"statvfs of /dev/shm on host {host.index} failed: {proc.stderr}"
    return int(proc.stdout)
