"""A Ray driver a test steers line by line: saves of run ``live`` that commit, wait at a gate, or fail.

``python -m tests.helpers.status_driver ADDRESS ROOT GATE`` joins the cluster at
ADDRESS and reads commands from stdin, answering each with one JSON line on stdout:

- ``save STEP``: save and wait for the commit -> ``{"step", "status", "committed_at"}``
  (the time of the MetadataActor's ``committed`` event);
- ``hold STEP``: a save whose shard write waits at the file GATE -> ``{"held": save_id}``
  once its ShardWriter reached the gate;
- ``fail REASON``: fail the run's saves in flight as ``RayckptCallback`` does when a worker
  group dies -> ``{"failed": [save ids]}``;
- ``release``: open the gate and wait for the held save -> ``{"released": outcome}``;
- ``quit``.
"""

from __future__ import annotations

import json
import os
import sys

import ray
import torch

RUN = "live"


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "step": step}


def main(address: str, root: str, gate: str) -> None:
    ray.init(address=address, namespace="rayckpt-tests", log_to_driver=False)
    from rayckpt.errors import SaveFailedError
    from rayckpt.ray.metadata.actor import get_metadata_actor
    from rayckpt.ray.rank.async_save import save_async
    from tests.helpers.gated_fs import gated_filesystem, wait_for_file

    meta = get_metadata_actor()
    ray.get(meta.register_run.remote(RUN, root))
    held = None
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "save":
            step = int(arg)
            entry = save_async(state(step), os.path.join(root, f"rayckpt-step-{step:08d}"), run=RUN, step=step).wait()
            events = ray.get(meta.events.remote(RUN))
            at = [e["time"] for e in events if e["kind"] == "committed" and e["step"] == step][-1]
            answer = {"step": step, "status": entry.status, "committed_at": at}
        elif cmd == "hold":
            step = int(arg)
            path = os.path.join(root, f"rayckpt-step-{step:08d}")
            held = save_async(state(step), path, run=RUN, step=step, filesystem=gated_filesystem(gate))
            wait_for_file(f"{gate}.reached", "the ShardWriter reaching the gate")
            answer = {"held": held.save_id}
        elif cmd == "fail":
            answer = {"failed": ray.get(meta.fail_pending.remote(RUN, arg))}
        elif cmd == "release":
            open(gate, "w").close()
            try:
                answer = {"released": held.wait().status}
            except SaveFailedError as exc:
                answer = {"released": f"failed: {exc}"}
        elif cmd == "quit":
            return
        else:
            answer = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
