"""What the main job's ``--sample-log`` recorded: the samples each step consumed, and the checks on them.

A step run by several worker groups (a restart redoes the steps after its checkpoint)
counts once, as the last group to run it ran it: what the finished run trained on.
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from dataclasses import dataclass, field

import torch

from rayckpt.data import DataPosition, permutation


@dataclass
class Step:
    epoch: int
    world_size: int
    attempt: str
    #: Each rank's sample ids, by rank.
    ids: dict[int, list[int]] = field(default_factory=dict)

    def all_ids(self) -> list[int]:
        return [i for r in sorted(self.ids) for i in self.ids[r]]


def _started(attempt: str) -> float:
    return float(attempt.split("-")[0])


def read_steps(log_dir) -> dict[int, Step]:
    """Step -> what the last worker group that ran it consumed."""
    steps: dict[int, Step] = {}
    for path in sorted(glob.glob(os.path.join(str(log_dir), "samples-*.jsonl"))):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                s = steps.get(rec["step"])
                if s is None or _started(rec["attempt"]) > _started(s.attempt):
                    s = steps[rec["step"]] = Step(rec["epoch"], rec["world_size"], rec["attempt"])
                if rec["attempt"] == s.attempt:
                    s.ids[rec["rank"]] = rec["ids"]
    return steps


def check_exactly_once(steps: dict[int, Step], length: int, last: DataPosition | None = None) -> dict[int, Counter]:
    """Every step 1..N was run by every rank of its group; every epoch before the last consumed each of the
    ``length`` samples exactly once; the last one none twice and, given the run's final position ``last``,
    exactly the samples that position says were consumed. Each epoch's Counter of ids."""
    assert sorted(steps) == list(range(1, len(steps) + 1)), sorted(steps)
    for n, s in steps.items():
        assert sorted(s.ids) == list(range(s.world_size)), (n, sorted(s.ids), s.world_size)
    per_epoch: dict[int, Counter] = {}
    for n in sorted(steps):
        per_epoch.setdefault(steps[n].epoch, Counter()).update(steps[n].all_ids())
    epochs = sorted(per_epoch)
    assert epochs == list(range(epochs[0], epochs[-1] + 1)), epochs
    for e in epochs[:-1]:
        assert sorted(per_epoch[e]) == list(range(length)), (e, "skipped", set(range(length)) - set(per_epoch[e]))
        assert set(per_epoch[e].values()) == {1}, (e, "repeated", [i for i, c in per_epoch[e].items() if c > 1])
    final = per_epoch[epochs[-1]]
    assert set(final.values()) == {1}, ("repeated", [i for i, c in final.items() if c > 1])
    if last is not None:
        assert last.epoch == epochs[-1]
        offsets = list(range(last.consumed)) + list(last.extras)
        assert sorted(final) == sorted(permutation(last)[torch.tensor(offsets, dtype=torch.long)].tolist())
    return per_epoch
