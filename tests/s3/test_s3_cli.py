"""The ``rayckpt`` command on ``s3://`` URIs, run as a user runs it (subprocesses, the AWS variables set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import rayckpt
from rayckpt.cli.commands import main
from rayckpt.storage.checkpoint_dir import CheckpointDir

pytestmark = pytest.mark.slow


def make_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"app": {"model": {"w": torch.randn(12, 4, generator=g), "b": torch.randn(4, generator=g)}, "n": 7}}


def rayckpt_cmd(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the session's dummy AWS variables included
    return subprocess.run(
        [sys.executable, "-m", "rayckpt", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def world(s3_server, tmp_path_factory):
    """A run of two checkpoints on S3, and every CLI command run against it."""
    prefix = "cli"
    storage = s3_server.uri(f"{prefix}/storage")
    ckpts = {}
    for step in (5, 10):
        ckpts[step] = s3_server.uri(f"{prefix}/storage/my-run/rayckpt-step-{step:08d}")
        rayckpt.save(make_state(), ckpts[step], block_size=32, metadata={"step": step})
    ckpt = ckpts[10]
    back, back_dcp = s3_server.uri(f"{prefix}/back"), s3_server.uri(f"{prefix}/back-dcp")
    jobs = {
        "ls": [("ls", storage, "--json")],
        "inspect": [("inspect", ckpt), ("inspect", ckpt, "--tensor", "app.model.w")],
        "verify": [("verify", ckpt)],
        "plan": [("plan", ckpt, "--world-size", "3", "--json")],
        "torch": [
            ("convert", ckpt, "full.pt", "--to", "torch"),
            ("convert", "full.pt", back, "--from", "torch", "--json"),
            ("verify", back),
        ],
        "dcp": [("convert", ckpt, "dcp", "--to", "dcp"), ("convert", "dcp", back_dcp, "--from", "dcp")],
    }
    work = str(tmp_path_factory.mktemp("cli-s3"))

    def run(chain):
        return [rayckpt_cmd(*args, cwd=work) for args in chain]

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run, chain) for name, chain in jobs.items()}
        out = {name: f.result() for name, f in futures.items()}
    for name, results in out.items():
        for r in results:
            assert r.returncode == 0, (name, r.args, r.stdout, r.stderr)
    return {"ckpts": ckpts, "ckpt": ckpt, "back": back, "back_dcp": back_dcp, "work": work, "out": out}


def test_ls_lists_the_s3_run_with_paths_to_paste_back(world):
    listed = json.loads(world["out"]["ls"][0].stdout)
    assert [(e["run"], e["step"], e["status"], e["path"]) for e in listed] == [
        ("my-run", step, "committed", world["ckpts"][step]) for step in (5, 10)
    ]


def test_inspect_and_verify_read_the_s3_checkpoint(world):
    inspect, tensor = world["out"]["inspect"]
    assert world["ckpt"] in inspect.stdout and "app.model.w" in inspect.stdout and "[12, 4]" in inspect.stdout
    assert "app.model.w" in tensor.stdout
    assert world["out"]["verify"][0].stdout.startswith(f"ok: {world['ckpt']}: "), world["out"]["verify"][0].stdout


def test_plan_reads_the_s3_manifest(world):
    plan = json.loads(world["out"]["plan"][0].stdout)
    assert plan["path"] == world["ckpt"] and plan["world_size"] == 3 and plan["saved_world_size"] == 1
    assert plan["bytes_needed"] == 12 * 4 * 4 + 4 * 4


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_convert_exports_from_s3_and_imports_back_into_s3_bit_exact(world, fmt):
    back = world["back"] if fmt == "torch" else world["back_dcp"]
    if fmt == "torch":
        assert json.loads(world["out"]["torch"][1].stdout)["dst"] == back
        full = torch.load(os.path.join(world["work"], "full.pt"), weights_only=True)
        assert torch.equal(full["app"]["model"]["w"], make_state()["app"]["model"]["w"])
    out = {"app": {"model": {"w": torch.zeros(12, 4), "b": torch.zeros(4)}, "n": 0}}
    rayckpt.load(out, back)
    want = make_state()
    assert torch.equal(out["app"]["model"]["w"], want["app"]["model"]["w"])
    assert torch.equal(out["app"]["model"]["b"], want["app"]["model"]["b"]) and out["app"]["n"] == 7
    assert rayckpt.verify(back).ok


def test_verify_finds_a_flipped_byte_in_an_s3_shard_file(s3_server, world, capsys):
    src = world["ckpts"][5]
    manifest = rayckpt.read_manifest(CheckpointDir.resolve(src))
    chunk = manifest.tensor("app.model.w").chunks[0]
    fs = s3_server.filesystem()
    key = s3_server.fs_path(f"cli/storage/my-run/rayckpt-step-00000005/{chunk.file}")
    with fs.open_input_stream(key) as f:
        data = bytearray(f.read())
    data[chunk.byte_offset + 40] ^= 0xFF
    with fs.open_output_stream(key) as f:
        f.write(bytes(data))
    assert main(["verify", src, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert [(p["kind"], p["file"]) for p in report["problems"]] == [("checksum", chunk.file)], report
