"""The faults a cluster has, on real hosts (``testbed.ray_hosts``): a host cut off by its link, and a host
crashed in the middle of a save, each under ``ray job submit -- python jobs/train.py`` with the memory tier on and
S3 (a host of its own) as storage.

Each faulty run ends where an uninterrupted run of the same flags ends: bit-identical with the same worker count,
within float tolerance after the group shrank (the same global batch, summed over fewer ranks). Ray's health
checks are tuned (``TUNED_HEALTH_CHECKS``), so a host that stops answering is declared dead in seconds.

One set of hosts for the module; the tests run in file order (the first is the reference run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from rayckpt.storage.catalog import checkpoint_dir_name
from testbed.host_jobs import HostJob
from testbed.hosts import Host, hosts_unavailable
from testbed.ray_hosts import S3_PORT, TUNED_HEALTH_CHECKS, RayHosts, build_ray_hosts
from tests.helpers.host_jobs import ONE_PER_HOST, catalog, completed, events, submit, summary, writers
from tests.helpers.ray_head import ROOT, TINY

pytestmark = pytest.mark.slow

#: Ray's health checks tuned; Ray Train's wait for the worker group it asks for first after a failure (the
#: group of three, which a cluster short of a host cannot place) shortened from its default minute.
ENV = {**TUNED_HEALTH_CHECKS, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}
#: Every run: one worker per host, a storage save every ``EVERY`` steps (and at the last), a memory save every
#: ``MEMORY`` steps between them.
STEPS, EVERY, MEMORY = 24, 16, 4
FLAGS = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--memory-every", str(MEMORY), *ONE_PER_HOST, *TINY]
#: A generous bound on the time from a crash to its save's rollback (the commit timeout is minutes).
ROLLBACK_BOUND_S = 60.0
#: Run on a host: listen at ``argv[1]:argv[2]`` and never accept: a connection opens, its request is never read.
TARPIT = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])), backlog=128)
time.sleep(3600)
"""
#: Run on host 0: compare two checkpoints' full states (``rayckpt.consolidate``); print what differs and by how much.
COMPARE = """
import json, sys, torch, rayckpt
a, b = (rayckpt.consolidate(uri, flat=True) for uri in sys.argv[2:4])
out = {"only_one": sorted(set(a) ^ set(b)), "differ": [], "max_abs_diff": 0.0, "tensors": 0}
for key in sorted(set(a) & set(b)):
    x, y = a[key], b[key]
    if isinstance(x, torch.Tensor):
        out["tensors"] += 1
        if x.shape != y.shape or x.dtype != y.dtype:
            out["differ"].append(key)
        elif not torch.equal(x, y):
            out["differ"].append(key)
            out["max_abs_diff"] = max(out["max_abs_diff"], (x.double() - y.double()).abs().max().item())
    elif x != y:
        out["differ"].append(key)
print(json.dumps(out))
"""
#: Run on the S3 host: each checkpoint directory of a run (``argv[1]``: its URI) and whether it holds exactly the
#: files its manifest names (no lease, nothing of a failed save); ``null`` for a directory with no manifest.
LEFT_ON_S3 = """
import json, sys
import pyarrow.fs as pafs
import rayckpt
from rayckpt.format.file_paths import SHARED_DIR, SHARED_PREFIX, is_shared
from rayckpt.format.manifest import MANIFEST_NAME
from rayckpt.storage.checkpoint_dir import CheckpointDir
fs, root = pafs.FileSystem.from_uri(sys.argv[1])
out, named = {}, set()
for info in fs.get_file_info(pafs.FileSelector(root)):
    if info.type != pafs.FileType.Directory or not info.base_name.startswith("rayckpt-step-"):
        continue
    listed = {f.path[len(info.path) + 1:] for f in fs.get_file_info(pafs.FileSelector(info.path, recursive=True))
              if f.type == pafs.FileType.File}
    if MANIFEST_NAME not in listed:
        out[info.base_name] = None
        continue
    manifest = rayckpt.read_manifest(CheckpointDir.resolve(sys.argv[1].replace(root, info.path, 1)))
    expected = {MANIFEST_NAME, *(f.path for f in manifest.files if not is_shared(f.path)), *manifest.table_files}
    named |= {f.path[len(SHARED_PREFIX):] for f in manifest.files if is_shared(f.path)}
    out[info.base_name] = sorted(listed ^ expected)
store = [f.base_name for f in fs.get_file_info(pafs.FileSelector(f"{root}/{SHARED_DIR}", allow_not_found=True))]
out[SHARED_DIR] = sorted(set(store) - named)  # the shared store: every file a checkpoint's
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hosts():
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with build_ray_hosts(3, shm_mb=256, s3_bucket="hostfaults", dashboard=True, env=ENV) as built:
        yield built


def uri(hosts: RayHosts, run: str, step: int | None = None) -> str:
    assert hosts.s3 is not None
    return hosts.s3.uri(f"runs/{run}" + (f"/{checkpoint_dir_name(step)}" if step is not None else ""))


def compare(hosts: RayHosts, run: str, reference: str = "reference") -> dict:
    """How ``run``'s last checkpoint differs from the reference run's (``COMPARE``)."""
    proc = hosts[0].python(COMPARE, "-", uri(hosts, run, STEPS), uri(hosts, reference, STEPS), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def address(host: Host, verb: str, ip: str) -> None:
    """Add (or delete) ``ip`` as an address of ``host``'s own (on its loopback): its connections to it stay on it."""
    proc = subprocess.run(
        ["ip", "-n", host.netns, "addr", verb, f"{ip}/32", "dev", "lo"], capture_output=True, text=True
    )
    assert proc.returncode == 0, f"ip addr {verb} {ip} on host {host.index}: {proc.stderr}"


def clients_putting(log_path: str, *texts: str) -> set[str]:
    """The addresses of the clients whose PUT requests the S3 server logged with each of ``texts`` in the path."""
    with open(log_path) as log:
        lines = [line for line in log if '"PUT ' in line and all(text in line for text in texts)]
    return {line.split()[0] for line in lines}


def left_on_s3(hosts: RayHosts, run: str) -> dict[str, list[str] | None]:
    assert hosts.s3_host is not None
    proc = hosts.s3_host.python(LEFT_ON_S3, uri(hosts, run), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_reference_run_uninterrupted(hosts: RayHosts):
    flags = ["--run-name", "reference", "--num-workers", "3", "--storage-path", uri(hosts, ""), *FLAGS]
    done = summary(submit(hosts, *flags))
    assert done["final_step"] == STEPS and done["num_workers"] == 3 and done["restarts"] == 0, done


def test_a_host_cut_off_mid_run_is_declared_dead_and_the_rest_restore_its_share_from_memory(hosts: RayHosts):
    """Host 2's link goes down mid-run: Ray declares its node dead, Ray Train starts the group again on the two
    hosts left (``--num-workers 2-3``), which restore the newest memory checkpoint, reading host 2's share from
    the replica a peer host holds. Once the link is back, host 2's node learns it was declared dead and ends, with
    the writer that held its memory: nothing it held is served again."""
    cut = hosts[2]
    job = HostJob(hosts, ["--run-name", "cut", "--num-workers", "2-3", "--storage-path", uri(hosts, ""), *FLAGS], ROOT)
    try:
        job.wait_for(f"step {2 * MEMORY + 2}/{STEPS}")  # two memory saves made
        cut.link_down()
        try:
            _, restart = job.wait_for("restart 1:", timeout=400)
            done = summary(completed(job, job.finish()))
        finally:
            cut.link_up()
    finally:
        job.close()
    assert "with 2 worker(s), from memory" in restart, restart
    assert done["final_step"] == STEPS and done["num_workers"] == 2 and done["restarts"] >= 1, done
    assert done["restored_tier"] == "memory", done

    differs = compare(hosts, "cut")
    assert differs["only_one"] == [] and differs["tensors"] > 0, differs
    assert differs["max_abs_diff"] < 1e-4, differs  # two ranks sum the same global batch in another order

    # Healed: host 2's node was told it is dead and ended, and every process of the host with it.
    deadline = time.monotonic() + 120
    while cut.running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not cut.running(), f"host 2 still runs {sorted(cut.running())} after its link came back"
    assert cut.ip not in hosts.ray_nodes()
    assert cut.ip not in writers(hosts)


def test_a_host_crashed_mid_save_fails_that_save_leaves_nothing_on_s3_and_the_run_restores_from_replicas(
    hosts: RayHosts,
):
    """A host that does not run rank 0 (host 2, else host 1) reaches, at the S3 host's address, a server of its own
    that accepts and never answers, so its share of the storage save of step ``EVERY`` stays in flight while the
    other hosts' shares reach S3; then every process of that host is killed. The save fails and is rolled back (the
    other ranks' files removed from S3), the host comes back (a reboot: a new Ray node), and the group of three
    restores the newest memory checkpoint, that host's share from the replica a peer holds, and ends bit-identical
    to the uninterrupted run."""
    s3 = hosts.s3
    assert s3 is not None and hosts.s3_host is not None
    if hosts[2].ip not in hosts.ray_nodes():  # cut off by the test before
        hosts.start_node(2)
    # Self-contained saves (--full-every 1): the test watches the PUTs of step EVERY's own directory.
    flags = ["--run-name", "crash", "--num-workers", "3", "--storage-path", uri(hosts, ""), *FLAGS, "--full-every", "1"]
    job = HostJob(hosts, flags, ROOT)
    s3_ip = hosts.s3_host.ip
    try:
        _, line = job.wait_for(f"step 2/{STEPS}")  # rank 0's line: nothing else asks S3 until step EVERY's save
        # Rank 0 claims each save's location on S3 first: the host crashed must not be rank 0's (Ray Train
        # orders the ranks by the order its workers started), else the claim waits at the stand-in forever.
        index = 1 if f"ip={hosts[2].ip})" in line else 2
        victim = hosts[index]
        address(victim, "add", s3_ip)
        victim.popen([sys.executable, "-c", TARPIT, s3_ip, str(S3_PORT)])
        deadline = time.monotonic() + 60
        while not victim.can_connect(s3_ip, S3_PORT):
            assert time.monotonic() < deadline, f"host {index}'s stand-in for S3 does not listen"
        saving = f"/{s3.bucket}/runs/crash/{checkpoint_dir_name(EVERY)}/"
        deadline = time.monotonic() + 300
        while len(writing := clients_putting(s3.log_path, saving, "-r0", ".arrow")) < 2:  # the others' shards
            assert time.monotonic() < deadline, f"only {writing} wrote shard files of step {EVERY}"
            time.sleep(0.05)
        crashed = time.time()
        victim.crash()
        address(victim, "del", s3_ip)
        hosts.start_node(index)
        _, restart = job.wait_for("restart 1:", timeout=400)
        done = summary(completed(job, job.finish()))
    finally:
        job.close()
    assert "with 3 worker(s), from memory" in restart, restart
    assert done["final_step"] == STEPS and done["num_workers"] == 3 and done["restarts"] >= 1, done

    happened = [{**e, "time": e["time"] - crashed} for e in events(hosts, "crash")]
    failed = [e for e in events(hosts, "crash", "failed") if e["step"] == EVERY]
    assert len(failed) == 1, (happened, job.output()[-15000:])
    assert 0 <= failed[0]["time"] - crashed < ROLLBACK_BOUND_S, (failed, crashed)
    # Every checkpoint directory left on S3 holds exactly its manifest's files, and the shared store only files a
    # manifest names: the failed save left nothing.
    left = left_on_s3(hosts, "crash")
    assert left and all(extra == [] for extra in left.values()), left
    committed = [step for run, step, status, _ in catalog(hosts[0], uri(hosts, "")) if run == "crash"]
    dirs = sorted(name for name in left if name != ".rayckpt-shared")
    assert dirs == [checkpoint_dir_name(step) for step in committed], (left, committed)

    differs = compare(hosts, "crash")
    assert differs == {"only_one": [], "differ": [], "max_abs_diff": 0.0, "tensors": differs["tensors"]}, differs
    assert differs["tensors"] > 0
