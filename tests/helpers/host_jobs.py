"""``jobs/train.py`` submitted to a cluster of real hosts (``testbed.ray_hosts``), and what tests read after it:
the job's summary, each host's ShardWriter, the run's catalog on storage, the MetadataActor's events.

Everything that talks to the cluster runs on host 0 (the cluster's addresses are reachable from the hosts only).
"""

from __future__ import annotations

import json
import subprocess

from testbed.host_jobs import HostJob, JobEnd, job_summary
from testbed.hosts import Host
from testbed.ray_hosts import RayHosts
from tests.helpers.ray_head import BIN, ROOT

#: Two CPUs per worker on 2-CPU hosts: Ray Train can place each worker only on a host of its own.
ONE_PER_HOST = ["--cpus-per-worker", "2"]
#: Run on host 0: each live node's ShardWriter (made now if it has none), by the node's address: its node id, pid and
#: replica listener's port, the replicas it received over the link and through Ray, and of its writes the ranks
#: whose shares it wrote and how each was staged.
WRITERS = """
import json, sys, ray
from rayckpt.ray.actors import NAMESPACE
from rayckpt.ray.writer.actor import get_shard_writer
ray.init(address=sys.argv[1], namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
found = {}
for node in ray.nodes():
    if node["Alive"]:
        writer = get_shard_writer(node["NodeID"])
        stats = ray.get(writer.debug_stats.remote(), timeout=60)
        found[node["NodeManagerAddress"]] = {
            "node": node["NodeID"][:12],
            "pid": stats["pid"],
            "port": ray.get(writer.mem_endpoint.remote(), timeout=60)[1],
            "received": stats["replicas_received"],
            "through_ray": stats["replicas_through_ray"],
            "ranks": sorted({(w["run"], w["rank"]) for w in stats["writes"]}),
            "staging": sorted({(w["run"], w["staging"]) for w in stats["writes"]}),
        }
print(json.dumps(found))
"""
#: Run on host 0: the MetadataActor's events of the run ``argv[2]``, as JSON.
EVENTS = """
import json, sys, ray
from rayckpt.ray.actors import NAMESPACE
from rayckpt.ray.metadata.actor import get_metadata_actor
ray.init(address=sys.argv[1], namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
print(json.dumps(ray.get(get_metadata_actor().events.remote(sys.argv[2]), timeout=60)))
"""


def submit(hosts: RayHosts, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    """``python jobs/train.py args`` submitted from host 0 and run to its end (``HostJob``): its driver log as
    stdout, return code 0 if it succeeded."""
    job = HostJob(hosts, args, cwd=ROOT)
    return completed(job, job.finish(timeout))


def completed(job: HostJob, end: JobEnd) -> subprocess.CompletedProcess[str]:
    """``end`` of ``job`` as a finished process: its driver log as stdout, 0 if it succeeded, else 1."""
    return subprocess.CompletedProcess(["ray", "job", job.id], 0 if end.succeeded else 1, end.output, "")


def summary(proc: subprocess.CompletedProcess[str]) -> dict:
    """The job's JSON summary (``job_summary``), asserting the job succeeded."""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    found = job_summary(proc.stdout)
    assert found is not None, f"no summary in the job's output: {proc.stdout[-4000:]}"
    return found


def on_host0(hosts: RayHosts, code: str, *args: str) -> object:
    """Run ``code`` (a snippet of this module, or one like them) on host 0 with the cluster's address first;
    the JSON on its last line of output."""
    proc = hosts[0].python(code, hosts.address, *args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def writers(hosts: RayHosts) -> dict[str, dict]:
    """What each host's ShardWriter reports (``debug_stats``), by the host's address."""
    found = on_host0(hosts, WRITERS)
    assert isinstance(found, dict)
    return found


def events(hosts: RayHosts, run: str, kind: str | None = None) -> list[dict]:
    """The MetadataActor's events of ``run`` (of ``kind`` only, if given), oldest first."""
    found = on_host0(hosts, EVENTS, run)
    assert isinstance(found, list)
    return [e for e in found if kind is None or e["kind"] == kind]


def catalog(host: Host, uri: str) -> list[tuple]:
    """``rayckpt ls <uri> --json`` on ``host``: (run, step, status, world size) of each checkpoint."""
    proc = host.run([f"{BIN}/python", "-m", "rayckpt", "ls", uri, "--json"], cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(e["run"], e["step"], e["status"], e["world_size"]) for e in json.loads(proc.stdout)]


def s3_puts(log_path: str) -> int:
    """How many PUT requests the S3 host has served."""
    with open(log_path) as f:
        return sum('"PUT ' in line for line in f)
