"""A job submitted to hosts of one machine (``testbed.ray_hosts``) and followed as it runs.

``HostJob`` submits ``python jobs/train.py ...`` from host 0 with ``ray job submit --no-wait`` and
reads the job's driver log on the head (``job-driver-<id>.log`` in the head's Ray session: the
driver's output and, forwarded by Ray, its workers'), each line timed as it is read. Following the
file, not ``ray job submit``'s own log stream: that stream may close while the job still runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .hosts import BIN
from .ray_hosts import RayHosts

#: How often the driver log is read for new lines, and the job's status asked.
POLL_S = 0.05
STATUS_POLL_S = 1.0
#: The job states after which nothing more runs.
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
NO_AGENT = "No available agent to submit job"
#: ``jobs/train.py`` flags of a GPT small enough for steps of a fraction of a second (a byte vocabulary).
TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16", "--vocab-size", "256"]
#: Run on host 0: the status of job ``argv[2]`` at the dashboard ``argv[1]``.
_STATUS_SNIPPET = """
import json, sys, urllib.request
with urllib.request.urlopen(f"{sys.argv[1]}/api/jobs/{sys.argv[2]}", timeout=30) as r:
    print(json.loads(r.read())["status"])
"""


@dataclass(frozen=True, slots=True)
class JobEnd:
    """How a job ended: its status (``SUCCEEDED``, ``FAILED``, ``STOPPED``) and its driver log's text."""

    status: str
    output: str

    @property
    def succeeded(self) -> bool:
        return self.status == "SUCCEEDED"

    def summary(self) -> dict[str, Any] | None:
        """The ``jobs/train.py`` summary in its output (``job_summary``), or None."""
        return job_summary(self.output)


def job_summary(output: str) -> dict[str, Any] | None:
    """The ``jobs/train.py`` summary in ``output`` (its last JSON line with ``final_step``), or None."""
    for line in reversed(output.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "final_step" in doc:
            return doc
    return None


class HostJob:
    """``python jobs/train.py args`` submitted to ``cluster`` (its dashboard) from host 0, its log followed.

    Args:
        cluster: Hosts started with ``dashboard=True``.
        args: The job's flags.
        cwd: The working directory shipped with the job (``--working-dir``): the repository.
        submit_timeout: Seconds to keep submitting while the head's job agent is not yet up.

    Raises:
        RuntimeError: ``ray job submit`` failed; the message has its output.
    """

    def __init__(self, cluster: RayHosts, args: Sequence[str], cwd: str, submit_timeout: float = 120.0) -> None:
        if cluster.dashboard is None:
            raise ValueError("the hosts were started without a dashboard (build_ray_hosts(dashboard=True))")
        self.cluster = cluster
        self.id = f"rayckpt-{uuid.uuid4().hex[:12]}"
        self.log_path = f"{cluster.hosts.root}/h0/session_latest/logs/job-driver-{self.id}.log"
        #: (time.time() when read, line) of every line read so far.
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._done = threading.Event()
        cmd = [f"{BIN}/ray", "job", "submit", "--address", cluster.dashboard, "--working-dir", ".", "--no-wait"]
        cmd += ["--submission-id", self.id, "--", "python", "jobs/train.py", *args]
        deadline = time.monotonic() + submit_timeout
        while True:
            proc = cluster[0].run(cmd, cwd=cwd, timeout=300)
            if proc.returncode == 0:
                break
            # The head's job agent comes up a little after the dashboard does.
            if NO_AGENT not in proc.stdout + proc.stderr or time.monotonic() > deadline:
                why = proc.stdout[-2000:] + proc.stderr[-3000:]
                raise RuntimeError(f"ray job submit failed ({proc.returncode}):\n{why}")
            time.sleep(1)
        self._reader = threading.Thread(target=self._follow, name=f"follow-{self.id}", daemon=True)
        self._reader.start()

    def _follow(self) -> None:
        while not os.path.exists(self.log_path):
            if self._done.wait(POLL_S):
                return
        with open(self.log_path, errors="replace") as f:
            partial = ""
            while True:
                chunk = f.readline()
                if not chunk:
                    if self._done.is_set():
                        return
                    self._done.wait(POLL_S)
                    continue
                partial += chunk
                if partial.endswith("\n"):
                    with self._changed:
                        self.lines.append((time.time(), partial))
                        self._changed.notify_all()
                    partial = ""

    def wait_for(self, match: str | Callable[[str], Any], timeout: float = 300.0) -> tuple[float, str]:
        """The first line that has ``match`` (a string) or that ``match(line)`` is true of, and when it was read.

        Raises:
            TimeoutError: No such line within ``timeout`` seconds, or the job ended without one; the
                message has the end of the log.
        """
        test = match if callable(match) else (lambda line: match in line)
        deadline, seen, next_status = time.monotonic() + timeout, 0, time.monotonic() + STATUS_POLL_S
        ended = False
        while True:
            with self._changed:
                for at, line in self.lines[seen:]:
                    if test(line):
                        return at, line
                seen = len(self.lines)
                if ended or time.monotonic() > deadline:
                    why = "the job ended" if ended else f"{timeout:.0f} s passed"
                    raise TimeoutError(f"{why} before a line with {match!r}:\n{self.output()[-6000:]}")
                self._changed.wait(POLL_S * 4)
            if time.monotonic() > next_status:  # one more look at the log once the job has ended
                ended, next_status = self.status() in TERMINAL, time.monotonic() + STATUS_POLL_S
                if ended:
                    time.sleep(POLL_S * 4)

    def status(self) -> str:
        """The job's status as the head's dashboard reports it (``PENDING``, ``RUNNING``, ``SUCCEEDED``...)."""
        proc = self.cluster[0].python(_STATUS_SNIPPET, str(self.cluster.dashboard), self.id, timeout=60)
        return proc.stdout.strip() if proc.returncode == 0 else "UNKNOWN"

    def finish(self, timeout: float = 600.0) -> JobEnd:
        """Wait for the job's end (at most ``timeout`` seconds: then ``TimeoutError``); its status and log."""
        deadline = time.monotonic() + timeout
        while (status := self.status()) not in TERMINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.id} still {status} after {timeout:.0f} s:\n{self.output()[-6000:]}")
            time.sleep(STATUS_POLL_S)
        self._done.set()
        self._reader.join(timeout=30)
        return JobEnd(status, self.output())

    def output(self) -> str:
        """The driver log read so far."""
        with self._changed:
            return "".join(line for _, line in self.lines)

    def close(self) -> None:
        """Stop following the log (the job itself goes with the cluster)."""
        self._done.set()
