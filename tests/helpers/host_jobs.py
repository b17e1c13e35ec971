"""``jobs/train.py`` submitted to a cluster of real hosts (``rayckpt.testing.ray_hosts``), and what tests read after it:
the job's summary, each host's ShardWriter, the run's catalog on storage, the MetadataActor's events.

Everything that talks to the cluster runs on host 0 (the cluster's addresses are reachable from the hosts only).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

from rayckpt.testing.hosts import Host
from rayckpt.testing.ray_hosts import RayHosts
from tests.helpers.ray_head import BIN, ROOT

#: Two CPUs per worker on 2-CPU hosts: Ray Train can place each worker only on a host of its own.
ONE_PER_HOST = ["--cpus-per-worker", "2"]
#: Run on host 0 after a job: each ShardWriter's host, its pid, the replicas it received and the ranks whose shares
#: it wrote.
WRITERS = """
import json, sys, ray
from rayckpt.ray.actors import NAMESPACE, writer_name
ray.init(address=sys.argv[1], namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
found = {}
for node in ray.nodes():
    if not node["Alive"]:
        continue
    try:
        writer = ray.get_actor(writer_name(node["NodeID"]))
    except ValueError:
        continue
    stats = ray.get(writer.debug_stats.remote(), timeout=60)
    found[node["NodeManagerAddress"]] = {
        "pid": stats["pid"],
        "received": stats["replicas_received"],
        "ranks": sorted({(w["run"], w["rank"]) for w in stats["writes"]}),
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


def submit_command(hosts: RayHosts, *args: str) -> list[str]:
    """``ray job submit --working-dir . -- python jobs/train.py args`` to the head's dashboard."""
    assert hosts.dashboard is not None
    cmd = [f"{BIN}/ray", "job", "submit", "--address", hosts.dashboard, "--working-dir", "."]
    return [*cmd, "--", "python", "jobs/train.py", *args]


def submit(hosts: RayHosts, *args: str) -> subprocess.CompletedProcess[str]:
    """``submit_command`` run on host 0 to the job's end (its output captured)."""
    deadline = time.monotonic() + 120
    while True:
        proc = hosts[0].run(submit_command(hosts, *args), cwd=ROOT, timeout=400)
        # The head's job agent comes up a little after the dashboard does.
        if "No available agent to submit job" not in proc.stderr or time.monotonic() > deadline:
            return proc
        time.sleep(1)


class Followed:
    """A job submitted on host 0 whose output is read as it comes: a test acts at a line of it."""

    def __init__(self, hosts: RayHosts, *args: str) -> None:
        self.lines: list[str] = []
        self.proc = hosts[0].popen(
            submit_command(hosts, *args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, text: str, timeout: float = 300.0) -> str:
        """The first line with ``text``, once the job printed it; AssertionError if the job ended or
        ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    raise AssertionError(f"the job never printed {text!r}:\n{self.output()[-6000:]}")
                self._changed.wait(min(left, 1.0))

    def finish(self, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """Wait for the job's end; its output as ``submit`` gives it (all on stdout)."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._reader.join(timeout=30)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.output(), "")

    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)


def summary(proc: subprocess.CompletedProcess[str]) -> dict:
    """The job's JSON summary (its last line of that shape), asserting the job succeeded."""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for line in reversed(proc.stdout.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "final_step" in doc:
            return doc
    raise AssertionError(f"no summary in the job's output: {proc.stdout[-4000:]}")


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
