"""``cluster.yaml`` brought up by Ray's cluster launcher: ``ray up`` with the local node provider on three hosts
(``testbed.launcher_hosts``: sshd on each, a PID namespace of its own), ``ray job submit -- python
jobs/train.py`` to the cluster it made, then ``ray down``; all from a fourth host, the user's machine.

The config is ``cluster.yaml`` with only the keys a cloud decides, or that need the internet, replaced
(``local_cluster_config``): its start commands (``ray stop`` first), file mounts and the rest run as shipped.
Needs sshd and rsync (``scripts/install_host_tools.sh``), and runs only when asked for (``RAYCKPT_RAY_UP=1``:
it takes several minutes, beside the suite's other host tests); skipped otherwise, with one line saying why.

One cluster for the module. The tests run in file order: each continues where the one before left it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from testbed.launcher_hosts import (
    REPLACED,
    LauncherHosts,
    build_launcher_hosts,
    foreign_processes,
    launcher_unavailable,
    local_cluster_config,
)
from testbed.ray_hosts import DASHBOARD_PORT, RAY_ENV
from tests.helpers.host_jobs import ONE_PER_HOST, catalog, summary
from tests.helpers.ray_head import ROOT, TINY

pytestmark = pytest.mark.slow

RUN = "rayup"
#: The environment variable that asks for this module's run.
ENABLE = "RAYCKPT_RAY_UP"
#: Besides the hosts' Ray settings, the suite's Ray Train settings (tests/conftest.py) reach the nodes' Ray.
TRAIN_ENV = {k: v for k, v in os.environ.items() if k.startswith("RAY_TRAIN_")}


@pytest.fixture(scope="module")
def cluster():
    if os.environ.get(ENABLE) != "1":
        pytest.skip(f"ray up on hosts runs only when asked for: {ENABLE}=1 (needs scripts/install_host_tools.sh)")
    reason = launcher_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with build_launcher_hosts(3, env={**RAY_ENV, **TRAIN_ENV}) as built:
        yield built


@pytest.fixture(scope="module")
def outsider():
    """A process outside the hosts that ``ray stop`` would take for Ray's (its command line names a Ray process):
    it must outlive every ``ray stop`` run on the hosts."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", "ray_process_reaper.py"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def config_path(cluster: LauncherHosts) -> str:
    with open(os.path.join(ROOT, "cluster.yaml")) as f:
        shipped = yaml.safe_load(f)
    head, *workers = cluster.nodes
    config = local_cluster_config(
        shipped,
        head_ip=head.ip,
        worker_ips=[host.ip for host in workers],
        ssh_user=cluster.ssh_user,
        ssh_private_key=cluster.ssh_private_key,
    )
    # Only the replaced keys differ; the start commands, file mounts and the rest are the shipped ones.
    assert {k: v for k, v in config.items() if k not in REPLACED} == {
        k: v for k, v in shipped.items() if k not in REPLACED
    }
    assert config["head_start_ray_commands"][0] == config["worker_start_ray_commands"][0] == "ray stop"
    path = f"{cluster.hosts.root}/cluster.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path


def dashboard(cluster: LauncherHosts) -> str:
    return f"http://{cluster.nodes[0].ip}:{DASHBOARD_PORT}"


def test_every_host_sees_only_its_own_processes(cluster: LauncherHosts, outsider: subprocess.Popen):
    for host in cluster.hosts.hosts:
        assert foreign_processes(host) == [], host.index


def test_ray_up_starts_the_head_and_the_workers_over_ssh(cluster: LauncherHosts, config_path: str):
    up = cluster.ray("up", "-y", "--no-config-cache", config_path, cwd=ROOT, timeout=900)
    assert up.returncode == 0, up.stdout[-6000:] + up.stderr[-3000:]
    # The head's autoscaler starts the workers (ray stop, ray start --address=$RAY_HEAD_IP:6379) over SSH.
    ips = sorted(host.ip for host in cluster.nodes)
    assert cluster.alive_nodes(dashboard(cluster), len(ips), timeout=600) == ips
    # The file mount copied the working tree to every node, each its own /home.
    for host in cluster.nodes:
        assert os.path.isfile(f"{host.disk_outside}/homes/ubuntu/rayckpt/jobs/train.py"), host.index


def test_the_job_trains_on_the_cluster_ray_up_made(cluster: LauncherHosts):
    storage = f"{cluster.hosts.root}/shared"  # one directory every host sees: an NFS mount's stand-in
    os.mkdir(storage)
    env = json.dumps({"env_vars": {"RAYCKPT_LOCAL_IS_SHARED": "1"}})
    cmd = ["job", "submit", "--address", dashboard(cluster), "--working-dir", ".", "--runtime-env-json", env]
    cmd += ["--", "python", "jobs/train.py", "--num-workers", "2", "--steps", "4", "--checkpoint-every", "2"]
    cmd += ["--run-name", RUN, "--storage-path", storage, *ONE_PER_HOST, *TINY]
    deadline = time.monotonic() + 120
    while True:
        proc = cluster.ray(*cmd, cwd=ROOT, timeout=600)
        # The head's job agent comes up a little after the dashboard does.
        if "No available agent to submit job" not in proc.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    done = summary(proc)
    assert done["final_step"] == 4 and done["num_workers"] == 2, done
    assert catalog(cluster.launcher, storage) == [(RUN, 2, "committed", 2), (RUN, 4, "committed", 2)]


def test_ray_down_stops_the_heads_ray_and_nothing_outside_the_hosts(
    cluster: LauncherHosts, config_path: str, outsider: subprocess.Popen
):
    down = cluster.ray("down", "-y", config_path, cwd=ROOT, timeout=600)
    assert down.returncode == 0, down.stdout[-6000:] + down.stderr[-3000:]
    head = cluster.nodes[0]
    left = [_cmdline(pid) for pid in head.running()]
    assert [cmd for cmd in left if "sshd" not in cmd and "nsenter" not in cmd] == [], left
    # Every `ray stop` (ray up's on each node, ray down's on the head) saw its host's processes only.
    assert outsider.poll() is None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""
