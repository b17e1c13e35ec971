"""Checkpoint fixtures and tampering shared by the test tiers: states, manifests, flipped bytes."""

from __future__ import annotations

import json
import os
import weakref

import torch

from rayckpt import tools


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(37, 5, generator=g),
            "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(3.5),
            "mask": torch.rand(6, generator=g) > 0.5,
            "ids": torch.arange(7, dtype=torch.int64) * (seed + 1),
        },
        "step": 10 + seed,
        "config": {"betas": (0.9, 0.99), "names": ["a", "b"], 3: "int key", "lr": float("nan")},
    }


def manifest_of(path) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def flip_byte(path: str, name: str, offset: int) -> None:
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def rewrite_manifest(path, edit) -> None:
    m = manifest_of(path)
    edit(m)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(m, f)


def track_read_tensor(monkeypatch) -> dict[str, int]:
    """Count the tensors ``CheckpointReader.read_tensor`` returns, and the most alive at once."""
    alive: list[weakref.ref] = []
    stats = {"read": 0, "peak": 0}
    original = tools.CheckpointReader.read_tensor

    def tracked(self, key):
        t = original(self, key)
        alive.append(weakref.ref(t))
        stats["read"] += 1
        stats["peak"] = max(stats["peak"], sum(r() is not None for r in alive))
        return t

    monkeypatch.setattr(tools.CheckpointReader, "read_tensor", tracked)
    return stats
