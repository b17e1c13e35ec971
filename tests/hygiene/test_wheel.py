"""The wheel holds the package and what a user's own tests need (``rayckpt.testing``: gloo ranks, a toy state, a
local S3 server), never the test-bed (``testbed/``: namespaces, sshd, Ray heads)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What only the test-bed may do: build namespaces and veth pairs, run sshd.
TEST_BED_WORDS = ("unshare", "netns", "veth", "sshd", "CLONE_NEW")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = out.glob("rayckpt-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_the_wheel_ships_the_package_and_the_user_s_test_helpers_not_the_test_bed(wheel):
    names = wheel.namelist()
    modules = {n for n in names if n.endswith(".py")}
    assert {n.split("/")[0] for n in modules} == {"rayckpt"}, sorted({n.split("/")[0] for n in modules})
    testing = sorted(n for n in modules if n.startswith("rayckpt/testing/"))
    assert testing == [
        "rayckpt/testing/__init__.py",
        "rayckpt/testing/multiproc.py",
        "rayckpt/testing/s3_server.py",
        "rayckpt/testing/toy.py",
    ]
    assert "rayckpt/py.typed" in names and "rayckpt/observe/alerts.py" in names
    # The manifest's schema: the file decoding loads, as in the repository.
    schema = "rayckpt/format/manifest.schema.json"
    assert wheel.read(schema) == (ROOT / schema).read_bytes()
    for name in sorted(modules):
        text = wheel.read(name).decode()
        found = [w for w in TEST_BED_WORDS if w in text]
        assert not found, f"{name} in the wheel holds test-bed code: {found}"


def test_the_test_bed_check_sees_test_bed_code():
    text = (ROOT / "testbed" / "hosts.py").read_text()
    assert any(w in text for w in TEST_BED_WORDS)
