"""Run a function on N local processes joined in a gloo process group.

For the demo, the benchmarks and tests: one fresh process per rank, a file-store
rendezvous, results returned in rank order. A failing rank's traceback (or a dead
rank's exit code) is raised in the caller, or returned per rank on request; a hung
group is killed at the timeout.

The ranks are forked by a ``torch.multiprocessing`` fork server that has imported
torch and its distributed packages once (``PRELOAD``), so no rank of any group pays
for importing them again. The server is a fresh interpreter started at the first
call (no state of the caller but its imports comes along); each rank takes the
caller's environment and working directory as they are at its call.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import torch.multiprocessing as mp

#: What the fork server imports before it forks a rank. ``__main__`` first, as spawn would load it in
#: each rank (a ``fn`` defined in a script), then what every rank imports anyway.
PRELOAD = ["__main__", "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "rayckpt"]


class RankFailedError(RuntimeError):
    """``run_ranks`` failed: a rank raised, died, or did not finish in time; the message has each rank's traceback."""


@dataclass(frozen=True, slots=True)
class RankFailure:
    """A rank that raised or died, in ``run_ranks(..., allow_failures=True)``'s results."""

    rank: int
    #: The process's exit code when it died without reporting (-9: SIGKILL); ``None`` when it raised.
    exitcode: int | None
    #: The traceback it raised, or what is known of its death.
    error: str


def _as_caller(env: dict[str, str], cwd: str, target: Callable, args: tuple) -> None:
    # The fork server's environment and directory are the first caller's: take this caller's.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


def start_process(target: Callable[..., Any], *args: Any, preload: tuple[str, ...] = ()) -> BaseProcess:
    """Start ``target(*args)`` in a process forked by the fork server (``PRELOAD`` and ``preload`` imported
    there, if this call starts it), in this process's environment and working directory; the process."""
    proc = _context(preload).Process(target=_as_caller, args=(dict(os.environ), os.getcwd(), target, args), daemon=True)
    proc.start()
    return proc


def _context(preload: tuple[str, ...] = ()) -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *preload])  # read when the server starts; later calls reuse it
    return ctx


@dataclass(frozen=True, slots=True)
class _Group:
    """The process group the ranks of one ``run_ranks`` join."""

    world_size: int
    init_file: str
    backend: str
    pg_timeout: float | None


def _entry(rank: int, group: _Group, fn: Callable, args: tuple, out: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world_size = group.world_size
    try:
        timeout = {} if group.pg_timeout is None else {"timeout": datetime.timedelta(seconds=group.pg_timeout)}
        init = f"file://{group.init_file}"
        dist.init_process_group(group.backend, init_method=init, rank=rank, world_size=world_size, **timeout)
        try:
            result = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # Plain pickle: tensors travel as bytes, not as shared-memory handles that die with us.
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        out.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    pg_timeout: float | None = None,
    allow_failures: bool = False,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return the results by rank.

    Each process joins one process group through a file-store rendezvous, runs
    ``fn`` and sends back its result; every process is ended before this returns.

    Args:
        fn: An importable (module-level) function; its result must be picklable.
        world_size: How many ranks (processes) to start.
        *args: Passed to ``fn`` after ``rank`` and ``world_size``.
        backend: The process group's backend.
        timeout: Seconds to wait for the first rank's result, then as long again
            for each next one; past it the remaining ranks are killed.
        pg_timeout: The process group's timeout in seconds (None: torch's
            default), which bounds how long the other ranks wait in a collective
            for a rank that died.
        allow_failures: Return a ``RankFailure(rank, exitcode, error)`` in a
            failed rank's place instead of raising.

    Returns:
        Each rank's result (or ``RankFailure``), in rank order.

    Raises:
        RankFailedError: A rank raised, or its process died without reporting (a
            signal, ``os._exit``; the message has its exit code, e.g. -9), unless
            ``allow_failures``; or a rank did not finish within ``timeout``.
    """
    out = _context().Queue()
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as tmp:
        group = _Group(world_size, os.path.join(tmp, "rendezvous"), backend, pg_timeout)
        procs = [start_process(_entry, r, group, fn, args, out) for r in range(world_size)]
        results: dict[int, Any] = {}
        failures: dict[int, RankFailure] = {}
        try:
            while len(results) + len(failures) < world_size:
                # ranks found dead before this wait: whatever they sent is in the queue by its end
                dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None}
                try:
                    rank, ok, value = out.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                except queue.Empty:
                    for r, code in dead.items():
                        if r not in results and r not in failures:
                            failures[r] = RankFailure(r, code, f"rank {r} exited with code {code} without a result")
                    if time.monotonic() >= deadline:
                        pending = sorted(set(range(world_size)) - set(results) - set(failures))
                        raise RankFailedError(
                            f"ranks {pending} did not finish within {timeout}s; failures so far: "
                            f"{ {r: f.error for r, f in failures.items()} }"
                        ) from None
                    continue
                deadline = time.monotonic() + timeout  # as long again for the next rank's result
                if ok:
                    results[rank] = pickle.loads(value)
                else:
                    failures[rank] = RankFailure(rank, None, value)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        if failures and not allow_failures:
            detail = "\n".join(f"--- rank {r} ---\n{f.error}" for r, f in sorted(failures.items()))
            raise RankFailedError(f"{len(failures)} of {world_size} rank(s) failed:\n{detail}")
        return [results[r] if r in results else failures[r] for r in range(world_size)]
