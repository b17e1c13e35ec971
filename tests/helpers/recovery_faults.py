"""What ``ray_workers.toy_train_loop`` does to itself for tests/recovery: die at a chosen point, kill its
node's ShardWriter, or hold still until Ray Train tears its worker group down.

Set by the train loop config (``tests.helpers.recovery_job`` builds it):

- ``die``: a list of faults ``{"rank": r, "step": s, "phase": p}``, each in its own attempt, in
  order: the run's first attempt meets the first, the attempt Ray Train restarts after it the
  second, and so on (the marker ``killed-<phase>.json`` under ``out`` says a fault happened; a
  restarted attempt finds the markers and goes on to the next fault). Rank ``r`` SIGKILLs itself:
  ``"between"``: before training step ``s``, once Ray Train has the previous save reported (the
  MetadataActor's ``reported`` event); ``"staging"``: inside the save of step ``s``, when its
  share is about to be copied into shared memory (rank 0 has registered the save, the other ranks
  go on writing theirs); ``"in_flight"``: right after the save of step ``s`` returned, once the
  rank's ShardWriter is blocked writing its shard file (the run's storage is a ``gated_fs``
  gated on that checkpoint; the fault's ``gate`` names the gate). ``"writer"``: the same moment,
  but the rank SIGKILLs its node's ShardWriter instead of itself. The marker records the wall
  time of the kill, the phase and the process killed.
- a fault's ``gate``: the gate file of the run's gated storage for that fault's checkpoint; the
  attempt after the fault opens it (the writers of the failed save then finish, and their late
  files must be removed).
- ``hold``: ``{"<world size>": step}``: with that many workers, after the save of ``step``
  committed and Ray Train reported it, rank 0 writes ``held-<world size>.json`` and every rank
  sleeps (at most ``HOLD_MAX_S``) until Ray Train stops the group: the driver removes or adds a
  node meanwhile, with no save in flight. Once per world size.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray

from rayckpt.ray.metadata.actor import get_metadata_actor
from rayckpt.ray.rank import async_save
from rayckpt.ray.writer.actor import get_shard_writer


def killed_marker(out: str, phase: str) -> str:
    """The file a fault of ``phase`` leaves under ``out`` (its time, rank, step and the pid killed)."""
    return os.path.join(out, f"killed-{phase}.json")


#: Bounds of waits that end once something expected happens (a test fails if it never does).
WAIT_MAX_S = 120.0
HOLD_MAX_S = 120.0


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` whole (temp file, rename): the driver polls for the file."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(data, f)
    os.replace(f"{path}.tmp", path)


def wait_until(check: Callable[[], bool], what: str, limit_s: float = WAIT_MAX_S) -> None:
    """Poll ``check`` until it holds; ``TimeoutError`` naming ``what`` after ``limit_s`` (a bound, not a timing)."""
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {limit_s:g}s")
        time.sleep(0.1)


def reported(run: str, step: int) -> bool:
    """Whether Ray Train's controller reported the checkpoint of ``step`` (``RayckptCallback.after_report``)."""
    events = ray.get(get_metadata_actor().events.remote(run))
    return any(e["kind"] == "reported" and e.get("step") == step for e in events)


def faults_done(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The faults of ``config['die']`` that earlier attempts met (their markers exist), in order."""
    return [f for f in config.get("die", []) if os.path.exists(killed_marker(config["out"], f["phase"]))]


class Faults:
    """One attempt's faults (every rank makes one, after ``restore``)."""

    def __init__(self, config: dict[str, Any], run: str, rank: int, world: int) -> None:
        self.out = config["out"]
        self.run, self.rank, self.world = run, rank, world
        self.save_at = sorted(config["save_at"])
        faults, done = config.get("die", []), faults_done(config)
        for fault in done:
            if fault.get("gate"):
                open(fault["gate"], "a").close()
        due = faults[len(done)] if len(done) < len(faults) else None
        self.die = due if due is not None and due["rank"] == rank else None
        self.hold_step = config.get("hold", {}).get(str(world))
        if os.path.exists(self._held_marker()):
            self.hold_step = None

    def _dies_at(self, step: int, phase: str) -> bool:
        return self.die is not None and (self.die["step"], self.die["phase"]) == (step, phase)

    def _record_kill(self, step: int, phase: str, pid: int) -> None:
        write_json(
            killed_marker(self.out, phase),
            {"time": time.time(), "phase": phase, "rank": self.rank, "step": step, "pid": pid},
        )

    def _die(self, step: int, phase: str) -> None:
        self._record_kill(step, phase, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)

    def before_step(self, step: int) -> None:
        """Before training ``step``: ``between`` dies here, once Ray Train knows the last save."""
        if self._dies_at(step, "between"):
            last = max(s for s in self.save_at if s < step)
            wait_until(lambda: reported(self.run, last), f"Ray Train reporting step {last}")
            self._die(step, "between")

    @contextlib.contextmanager
    def saving(self, step: int) -> Iterator[None]:
        """Around ``ckpt.save(step, ...)``: ``staging`` dies when the share is about to be copied."""
        if not self._dies_at(step, "staging"):
            yield
            return
        original = async_save.AsyncSaver.stage_share

        def die_staging(saver: Any, *args: Any, **kwargs: Any) -> Any:
            self._die(step, "staging")

        async_save.AsyncSaver.stage_share = die_staging
        try:
            yield
        finally:
            async_save.AsyncSaver.stage_share = original

    def after_save(self, step: int, ckpt: Any) -> None:
        """After ``ckpt.save(step, ...)`` returned: ``in_flight`` dies, ``writer`` kills the node's
        ShardWriter, each once this rank's shard file is blocked at the gate; ``hold`` holds."""
        if self._dies_at(step, "in_flight") or self._dies_at(step, "writer"):
            mine = f"-r{self.rank:05d}-"
            reached = f"{self.die['gate']}.reached"
            wait_until(
                lambda: os.path.exists(reached) and mine in open(reached).read(), "this rank's write at the gate"
            )
            if self.die["phase"] == "in_flight":
                self._die(step, "in_flight")
            writer = get_shard_writer()
            pid = ray.get(writer.__ray_call__.remote(lambda w: os.getpid()))
            self._record_kill(step, "writer", pid)
            os.kill(pid, signal.SIGKILL)
        if step == self.hold_step:
            ckpt.wait()
            if self.rank == 0:
                wait_until(lambda: reported(self.run, step), f"Ray Train reporting step {step}")
                write_json(self._held_marker(), {"time": time.time(), "step": step})
            time.sleep(HOLD_MAX_S)  # Ray Train stops this group meanwhile; if it does not, the run goes on

    def _held_marker(self) -> str:
        return os.path.join(self.out, f"held-{self.world}.json")
