"""Run a function on N local processes joined in a gloo process group.

For the demo, the benchmarks and tests: ``torch.multiprocessing`` spawn, one
process per rank, a file-store rendezvous, results returned in rank order. A
failing rank's traceback is raised in the caller; a hung group is killed at the
timeout.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class RankFailedError(RuntimeError):
    pass


def _entry(rank: int, world_size: int, init_file: str, backend: str, fn: Callable, args: tuple, out: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle: tensors travel as bytes, not as shared-memory handles that die with us.
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        out.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: float = 300.0
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``fn`` must be importable (module-level) and its result picklable.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, init_file, backend, fn, args, out), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        try:
            while len(results) + len(failures) < world_size:
                try:
                    rank, ok, value = out.get(timeout=timeout)
                except queue.Empty:
                    raise RankFailedError(
                        f"ranks {sorted(set(range(world_size)) - set(results) - set(failures))} did not finish "
                        f"within {timeout}s; failures so far: {failures}"
                    ) from None
                if ok:
                    results[rank] = pickle.loads(value)
                else:
                    failures[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        if failures:
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise RankFailedError(f"{len(failures)} of {world_size} rank(s) failed:\n{detail}")
        return [results[r] for r in range(world_size)]
