"""The main job across real hosts (``testbed.ray_hosts``): three Ray nodes, each in its own network and
mount namespace, and an S3 host; ``ray job submit -- python jobs/train.py`` from host 0, as a user submits it.

Three workers, one per host, save to S3 and to the memory tier, whose replicas cross hosts over the writers'
replica link; the run resumes with two workers; node-local storage is refused before training when the nodes
run on several hosts.

One set of hosts for the module. The tests run in file order: the resume continues the first test's run.
"""

from __future__ import annotations

import os

import pytest

from rayckpt.storage.catalog import checkpoint_dir_name
from testbed.hosts import Host, hosts_unavailable
from testbed.ray_hosts import RayHosts, build_ray_hosts
from tests.helpers.host_jobs import ONE_PER_HOST, catalog, s3_puts, submit, summary, writers
from tests.helpers.ray_head import TINY

pytestmark = pytest.mark.slow

RUN = "hostjob"


@pytest.fixture(scope="module")
def hosts():
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with build_ray_hosts(3, shm_mb=256, s3_bucket="hostjob", dashboard=True) as built:
        yield built


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
    # replicas over the replica link, from a writer on another host (one writer per host).
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


def disk_files(host: Host) -> list[str]:
    """Every file on ``host``'s disk, relative to it."""
    found = []
    for dirpath, _, filenames in os.walk(host.disk_outside):
        found += [os.path.relpath(os.path.join(dirpath, name), host.disk_outside) for name in filenames]
    return sorted(found)
