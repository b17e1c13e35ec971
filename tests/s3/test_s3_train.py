"""Ray Train on S3: a TorchTrainer run whose ``RunConfig.storage_filesystem`` is a ``pyarrow.fs.S3FileSystem``:
the suite's run on a filesystem given as a ``pyarrow.fs`` object that is not local (no memory maps, ranged reads)."""

from __future__ import annotations

import pytest
import torch

import rayckpt
from rayckpt.tools.listing import ls
from tests.helpers.ray_train import fit

pytestmark = pytest.mark.slow


def test_torch_trainer_saves_with_2_and_resumes_with_3_on_s3(ray_session, s3_server, tmp_path):
    # Credentials inside the object: Ray's processes started before the S3 fixture set the AWS variables.
    fs = s3_server.filesystem()
    storage = s3_server.fs_path("train")
    out = tmp_path / "out"
    out.mkdir()
    result = fit(storage, out, 2, 2, {2}, name="s3run", filesystem=fs)
    assert result.checkpoint.path == f"{storage}/s3run/rayckpt-step-00000002"
    listed = ls(s3_server.uri("train"))
    assert [(e.run, e.step, e.status, e.world_size) for e in listed] == [("s3run", 2, "committed", 2)]
    saved = torch.load(out / "final-2.pt", weights_only=False)
    fit(storage, out, 3, 2, set(), name="s3run", filesystem=fs)
    restored = torch.load(out / "restored-3.pt", weights_only=False)
    assert restored["step"] == 2
    for key, value in saved["state"].items():
        assert torch.equal(restored["state"][key], value), key
    assert rayckpt.verify(s3_server.uri("train/s3run/rayckpt-step-00000002")).ok
