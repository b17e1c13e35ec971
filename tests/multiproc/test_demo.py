"""``jobs/demo.py`` as a user runs it: save with 2 processes, load with 1, outputs match, nothing left behind."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from rayckpt.examples import demo

pytestmark = pytest.mark.slow


def test_demo_matches_and_removes_its_temp_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert demo.main(["--save-ranks", "2", "--load-ranks", "1"]) == 0
    out = capsys.readouterr().out
    assert "[rank 0] Outputs MATCH; model + optimizer state identical" in out
    assert json.loads(out.splitlines()[-1]) == {"checkpoint": None, "saved_by": 2, "loaded_by": 1, "match": True}
    assert os.listdir(tmp_path) == []  # the checkpoint's temporary directory is gone
