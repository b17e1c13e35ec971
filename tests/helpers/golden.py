"""The golden save: a fixed state whose checkpoint, saved by the code before the package was
layered (commit 4913f20), is recorded in ``tests/data/golden_save.json``: its manifest
(less ``created``) and the SHA-256 of each shard file. Any save path must reproduce it."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from tests.helpers.checkpoints import manifest_of

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "golden_save.json")
#: The save id the golden checkpoint was written with.
SAVE_ID = "20260101T000000-01234567"
BLOCK_SIZE = 256


def golden_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "w": torch.randn(33, 7, generator=g),
            "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "ids": torch.arange(9, dtype=torch.int64),
            "mask": torch.rand(5, generator=g) > 0.5,
        },
        "step": 12,
        "lr": 1e-3,
        "note": ("a", 1),
        "nested": {"k": [1, 2.5, None]},
    }


def describe(path: str) -> dict[str, Any]:
    """What the golden file records of the checkpoint at ``path``: a version-4 manifest with its
    chunk table's rows inline (``checkpoints.manifest_of``), and the shard files, not that table."""
    manifest = manifest_of(path)
    manifest.pop("created")
    manifest.pop("chunk_table", None)
    files = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".arrow") and not name.endswith("-chunks.arrow"):
            with open(os.path.join(path, name), "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()
    return {"manifest": manifest, "files": files}


def expected() -> dict[str, Any]:
    with open(GOLDEN) as f:
        return json.load(f)
