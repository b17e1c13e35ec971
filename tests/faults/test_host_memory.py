"""The memory tier across real hosts (``testbed.ray_hosts``) when a host's resources fail it: three Ray
nodes, each in its own network and mount namespace, and an S3 host; ``ray job submit -- python jobs/train.py``
from host 0 with three workers, one per host, S3 storage and the memory tier on.

- One host's ``/dev/shm`` filled by another process, leaving Ray's object store its room: that node's
  memory tier has no room, so memory saves go to storage with one WARNING naming the node and why; the
  node's ranks stage through the object store; every storage checkpoint commits.
- The replica link to one host blocked by a firewall rule while Ray still reaches it: the replicas for that
  host go through Ray's object store, with one WARNING for it in the sending ShardWriter's log; the job and
  its memory saves commit.

One set of hosts for the module, in file order: the first test runs on hosts no job ran on yet. Each test
undoes its fault (the fixture too, whatever happened).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest

from testbed.hosts import Host, hosts_unavailable
from testbed.ray_hosts import RayHosts, build_ray_hosts
from tests.helpers.host_jobs import ONE_PER_HOST, catalog, submit, summary, writers
from tests.helpers.ray_head import TINY

pytestmark = pytest.mark.slow

SHM_MB = 256
OBJECT_STORE_MB = 80
#: Where the filler of a host's ``/dev/shm`` goes (the other process that fills it).
FILLER = "/dev/shm/filler"


@pytest.fixture(scope="module")
def hosts():
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    built = build_ray_hosts(3, shm_mb=SHM_MB, object_store_mb=OBJECT_STORE_MB, s3_bucket="hostmem", dashboard=True)
    undo: list[Callable[[], None]] = []
    try:
        yield built, undo
    finally:
        try:
            for step in reversed(undo):
                step()
        finally:
            built.close()


def committed(host: Host, uri: str) -> list[tuple]:
    """(run, step, status) of each checkpoint at ``uri`` (``rayckpt ls`` on ``host``)."""
    return [entry[:3] for entry in catalog(host, uri)]


def ip_rule(host: Host, verb: str, peer: str, port: int) -> None:
    """Add (or delete) the rule in ``host``'s network that refuses its TCP connections to ``peer:port``."""
    cmd = ["ip", "-n", host.netns, "rule", verb, "to", peer, "ipproto", "tcp", "dport", str(port), "prohibit"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"`{' '.join(cmd)}` failed on host {host.index}: {proc.stderr.strip()}"


def test_a_host_whose_shm_another_process_filled_sends_memory_saves_to_storage_with_one_warning(hosts):
    cluster, undo = hosts
    assert cluster.s3 is not None
    full = cluster[1]
    free = shm_free(full)
    # Leave Ray's object store its room (its pages are taken only as objects are made), and no more.
    filled = full.run(["fallocate", "-l", str(free - (OBJECT_STORE_MB << 20)), FILLER])
    assert filled.returncode == 0, f"filling /dev/shm of host {full.index} failed: {filled.stderr}"
    undo.append(lambda: full.run(["rm", "-f", FILLER]))
    assert shm_free(full) <= OBJECT_STORE_MB << 20

    uri = cluster.s3.uri("shm")
    flags = ["--run-name", "shmfull", "--storage-path", uri, "--num-workers", "3", *ONE_PER_HOST, *TINY]
    proc = submit(cluster, "--steps", "3", "--checkpoint-every", "3", "--memory-every", "1", *flags)
    done = summary(proc)
    assert done["final_step"] == 3, done
    output = proc.stdout + proc.stderr
    assert "(memory) committed step" not in output, output[-6000:]
    # Every memory save went to storage instead: each step is a storage checkpoint.
    assert committed(cluster[0], uri) == [("shmfull", step, "committed") for step in (1, 2, 3)]
    node = writers(cluster)[full.ip]["node"]
    warned = [line for line in output.splitlines() if "goes to storage, not memory" in line]
    assert len(warned) == 1, warned
    why = f"step 1 goes to storage, not memory: node {node} has 0 bytes free in /dev/shm"
    assert why in warned[0] and "its free space less Ray's object store" in warned[0], warned

    # Its rank staged through Ray's object store (which had its room); the others in their /dev/shm.
    staging = {ip: {how for run, how in found["staging"] if run == "shmfull"} for ip, found in writers(cluster).items()}
    assert staging[full.ip] == {"object_store"}, staging
    assert all(staging[host.ip] == {"shm"} for host in (cluster[0], cluster[2])), staging

    for step in reversed(undo):
        step()
    undo.clear()
    assert full.run(["ls", "/dev/shm"]).stdout.split() == [], f"/dev/shm of host {full.index} is not empty"


def test_replicas_to_a_host_whose_link_is_firewalled_go_through_ray_with_one_warning(hosts):
    cluster, undo = hosts
    assert cluster.s3 is not None
    before = writers(cluster)  # made now: each listens on a port of its own from here on
    blocked = cluster[2]
    port, node = before[blocked.ip]["port"], before[blocked.ip]["node"]
    for host in (cluster[0], cluster[1]):
        ip_rule(host, "add", blocked.ip, port)
        undo.append(lambda host=host: ip_rule(host, "del", blocked.ip, port))
    assert not cluster[0].can_connect(blocked.ip, port) and not cluster[1].can_connect(blocked.ip, port)
    assert cluster.ray_nodes() == sorted(host.ip for host in cluster), "Ray lost a node behind the rule"

    uri = cluster.s3.uri("link")
    flags = ["--run-name", "firewalled", "--storage-path", uri, "--num-workers", "3", *ONE_PER_HOST, *TINY]
    proc = submit(cluster, "--steps", "3", "--checkpoint-every", "3", "--memory-every", "1", *flags)
    done = summary(proc)
    assert done["final_step"] == 3, done
    output = proc.stdout + proc.stderr
    # The first memory save is never skipped (no save before it is unwritten); a later one may be.
    assert "firewalled (memory) committed step 1" in output, output[-6000:]
    assert committed(cluster[1], uri) == [("firewalled", 3, "committed")]

    after = writers(cluster)
    assert after[blocked.ip]["received"] == before[blocked.ip]["received"], after
    assert after[blocked.ip]["through_ray"]["files"] > 0 and after[blocked.ip]["through_ray"]["bytes"] > 0, after
    others = [host.ip for host in (cluster[0], cluster[1])]
    assert all(after[ip]["received"]["files"] > before[ip]["received"]["files"] for ip in others), after
    assert all(after[ip]["through_ray"] == {"files": 0, "bytes": 0} for ip in others), after
    # The sending ShardWriter warned once. It outlives jobs (made by a job before, or by `writers`): Ray sends a
    # detached actor's log lines to the job that made it, so they are in its log on its host, not in this job's
    # output.
    warned = sender_logs(cluster)
    assert len(warned) == 1, warned
    assert f"cannot reach the replica listener at {blocked.ip}:{port}" in warned[0], warned
    assert f"replicas to node {node} go through Ray instead" in warned[0], warned

    for step in reversed(undo):
        step()
    undo.clear()
    assert cluster[0].can_connect(blocked.ip, port), f"host 0 still cannot reach {blocked.ip}:{port}"


def sender_logs(cluster: RayHosts) -> list[str]:
    """The replica link's WARNING lines in every Ray worker log of the hosts (where a writer's logs are kept)."""
    proc = subprocess.run(
        ["grep", "-rh", "go through Ray instead", cluster.hosts.root, "--include=worker-*"],
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
