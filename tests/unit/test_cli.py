"""The ``rayckpt`` command as a user runs it (subprocesses), and every error path of ``cli.main``."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import rayckpt
from rayckpt import tools
from rayckpt.cli import commands as cli
from tests.helpers.checkpoints import manifest_of, write_manifest_doc

# --json schemas: the fields scripts may rely on (docs/CLI.md).
LISTING_FIELDS = ["run", "step", "path", "status", "created", "world_size", "bytes", "save_id", "error"]
INSPECT_FIELDS = [
    "path",
    "save_id",
    "version",
    "created",
    "world_size",
    "block_size",
    "checksum",
    "total_bytes",
    "user_metadata",
    "files",
    "tensors",
    "values",
    "bytes_written",
    "bytes_shared",
]
TENSOR_FIELDS = ["key", "dtype", "shape", "numel", "nbytes", "num_chunks", "files"]
SUMMARY_FIELDS = ["key", "dtype", "shape", "numel", "min", "max", "mean", "norm", "first"]
VERIFY_FIELDS = ["path", "ok", "files_checked", "chunks_checked", "bytes_checked", "problems"]
PROBLEM_FIELDS = ["kind", "message", "file", "key", "start", "end"]
PLAN_FIELDS = [
    "path",
    "saved_world_size",
    "world_size",
    "bytes_needed",
    "bytes_read",
    "read_amplification",
    "balance",
    "ranks",
]
RANK_FIELDS = ["rank", "bytes_needed", "bytes_read", "reads", "files"]
CONVERT_FIELDS = ["src", "dst", "format", "direction", "tensors", "values", "bytes", "files"]


def make_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "app": {
            "model": {"w": torch.randn(12, 4, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16)},
            "extra.step": 7,
        }
    }


def rayckpt_cmd(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "rayckpt", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def assert_one_line_error(r: subprocess.CompletedProcess, status: int, *fragments: str) -> None:
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayckpt: error: "), r.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Storage with a run of two checkpoints, a corrupt copy, and things that are not checkpoints."""
    root = tmp_path_factory.mktemp("cli")
    storage = root / "storage"
    for step in (5, 10):
        path = storage / "my-run" / f"rayckpt-step-{step:08d}"
        rayckpt.save(make_state(), str(path), block_size=32, metadata={"step": step, "run": "my-run"})
    ckpt = str(storage / "my-run" / "rayckpt-step-00000010")
    corrupt = str(root / "corrupt")
    shutil.copytree(ckpt, corrupt)
    chunk = manifest_of(root / "corrupt")["entries"]["app.model.w"]["chunks"][0]
    with open(os.path.join(corrupt, chunk["file"]), "r+b") as f:
        f.seek(chunk["byte_offset"] + 40)
        f.write(b"\xff")
    bad_manifest = root / "bad_manifest"
    shutil.copytree(ckpt, bad_manifest)
    (bad_manifest / "manifest.json").write_text("{oops")
    (root / "empty").mkdir()
    return {"root": str(root), "storage": str(storage), "ckpt": ckpt, "corrupt": corrupt, "chunk": chunk}


@pytest.fixture(scope="module")
def runs(world):
    """Every subprocess command of this module, run a few at a time (each pays Python + torch start-up)."""
    root, ckpt = world["root"], world["ckpt"]
    jobs = {
        "ls": [("ls", world["storage"])],
        "inspect": [("inspect", ckpt)],
        "tensor": [("inspect", ckpt, "--tensor", "app.model.w")],
        "verify": [("verify", ckpt)],
        "verify_corrupt": [("verify", world["corrupt"], "--json")],
        "plan": [("plan", ckpt, "--world-size", "3")],
        "convert": [
            ("convert", ckpt, "full.pt", "--to", "torch"),
            ("convert", "full.pt", "back", "--from", "torch", "--json"),
            ("verify", "back"),
        ],
        "err_missing": [("inspect", "does-not-exist")],
        "err_not_ckpt": [("verify", os.path.join(root, "empty"))],
        "err_bad_arg": [("plan", ckpt, "--world-size", "zero")],
        "err_corrupt_manifest": [("inspect", os.path.join(root, "bad_manifest"))],
    }
    work = os.path.join(root, "cwd")
    os.makedirs(work)

    def run(chain):
        return [rayckpt_cmd(*args, cwd=work) for args in chain]

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run, chain) for name, chain in jobs.items()}
        out = {name: f.result() for name, f in futures.items()}
    return {name: results if len(results) > 1 else results[0] for name, results in out.items()}, work


def run_json(capsys, *argv: str) -> tuple[int, object]:
    """``--json`` output, in process (the subprocess runs cover the same code path as text)."""
    status = cli.main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert err == ""
    return status, json.loads(out)


def test_ls_lists_the_runs_checkpoints(runs, world, capsys):
    results, _ = runs
    r = results["ls"]
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["RUN", "STEP", "STATUS", "CREATED", "RANKS", "SIZE", "PATH"]
    assert [line.split()[:3] for line in lines[1:]] == [["my-run", "5", "committed"], ["my-run", "10", "committed"]]
    _, entries = run_json(capsys, "ls", world["storage"], "--run", "my-run")
    assert [list(e) for e in entries] == [LISTING_FIELDS] * 2
    assert [e["step"] for e in entries] == [5, 10] and entries[1]["path"] == world["ckpt"]


def test_inspect_shows_keys_dtypes_shapes_and_files(runs, world, capsys):
    results, _ = runs
    r = results["inspect"]
    assert r.returncode == 0 and r.stderr == ""
    assert "2 tensors (200 B), 1 value, 2 files" in r.stdout
    assert any(
        line.split() == ["app.model.w", "float32", "[12,", "4]", "1", "192", "B"] for line in r.stdout.splitlines()
    )
    assert "app.extra.step  7" in r.stdout
    _, info = run_json(capsys, "inspect", world["ckpt"])
    assert list(info) == INSPECT_FIELDS and list(info["tensors"][0]) == TENSOR_FIELDS
    assert info["user_metadata"] == {"step": 10, "run": "my-run"}
    assert info["values"] == [{"key": "app.extra.step", "value": 7}]


def test_inspect_tensor_prints_the_assembled_values(runs, world, capsys):
    results, _ = runs
    w = make_state()["app"]["model"]["w"]
    r = results["tensor"]
    assert r.returncode == 0
    rows = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert rows["shape"] == "[12, 4] (48 elements)"
    assert float(rows["min"]) == pytest.approx(w.min().item(), rel=1e-5)
    assert float(rows["norm"]) == pytest.approx(w.double().norm().item(), rel=1e-5)
    assert rows["first"].startswith(f"[{w.reshape(-1)[0].item():.6g}, ") and rows["first"].endswith(", ...]")
    _, s = run_json(capsys, "inspect", world["ckpt"], "--tensor", "app.model.b")
    b = make_state()["app"]["model"]["b"]
    assert list(s) == SUMMARY_FIELDS and s["dtype"] == "bfloat16" and s["first"] == b.tolist()


def test_verify_passes_quietly_without_a_terminal(runs):
    results, _ = runs
    r = results["verify"]
    assert r.returncode == 0 and r.stderr == ""  # no progress bar on a pipe
    assert r.stdout.startswith("ok: ") and "2 files, 2 chunks, 200 B read" in r.stdout


def test_verify_fails_with_each_problem_named(runs, world, capsys):
    results, _ = runs
    r = results["verify_corrupt"]
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert list(report) == VERIFY_FIELDS and report["ok"] is False
    (p,) = report["problems"]
    start = world["chunk"]["byte_offset"] + 32
    assert list(p) == PROBLEM_FIELDS
    assert (p["kind"], p["file"], p["key"], p["start"], p["end"]) == (
        "checksum",
        world["chunk"]["file"],
        "app.model.w",
        start,
        start + 32,
    )
    assert cli.main(["verify", world["corrupt"]]) == 1
    first, last = capsys.readouterr().out.splitlines()
    assert first.startswith("checksum  ") and world["chunk"]["file"] in first and f"[{start}, {start + 32})" in first
    assert last.startswith("FAILED: ") and "1 problem;" in last


def test_plan_prints_per_rank_reads(runs, world, capsys):
    results, _ = runs
    r = results["plan"]
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert lines[1].split() == ["RANK", "NEEDED", "READ", "READS", "FILES"] and len(lines) == 6
    assert "read amplification" in lines[-1]
    _, p = run_json(capsys, "plan", world["ckpt"], "--world-size", "3")
    assert list(p) == PLAN_FIELDS and list(p["ranks"][0]) == RANK_FIELDS
    want = rayckpt.plan(world["ckpt"], 3)
    assert [r["bytes_read"] for r in p["ranks"]] == [r.bytes_read for r in want.ranks]
    assert p["read_amplification"] == want.read_amplification


def test_convert_round_trip_from_the_command_line(runs, world):
    results, work = runs
    to, back, check = results["convert"]
    assert to.returncode == 0 and to.stdout.startswith("wrote torch ") and to.stderr == ""
    info = json.loads(back.stdout)
    assert list(info) == CONVERT_FIELDS and info["direction"] == "from" and info["tensors"] == 2
    assert check.returncode == 0
    full = rayckpt.consolidate(os.path.join(work, "back"))  # the nesting saved, dotted keys and all
    assert full.keys() == {"app"} and full["app"].keys() == {"model", "extra.step"} and full["app"]["extra.step"] == 7
    assert torch.equal(full["app"]["model"]["w"], make_state()["app"]["model"]["w"])


@pytest.mark.parametrize(
    "name, status, fragments",
    [
        ("err_missing", 2, ["does-not-exist: no such file or directory"]),
        ("err_not_ckpt", 2, ["is not a rayckpt checkpoint (no manifest.json)"]),
        ("err_bad_arg", 2, ["argument --world-size/-n: invalid integer 'zero'", "rayckpt plan --help"]),
        ("err_corrupt_manifest", 1, ["manifest.json: not valid JSON"]),
    ],
)
def test_errors_are_one_line_with_a_meaningful_status(runs, name, status, fragments):
    results, _ = runs
    assert_one_line_error(results[name], status, *fragments)


def test_console_script_is_installed():
    script = shutil.which("rayckpt", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("console script not installed in this environment (pip install -e .)")
    r = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"rayckpt {rayckpt.__version__}"


# ---------------------------------------------------------------------------
# In process: the rest of the error paths, and the progress bar


def main_lines(capsys, *argv: str) -> tuple[int, str, list[str]]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err.splitlines()


@pytest.mark.parametrize(
    "argv, status, fragment",
    [
        (["plan", "{ckpt}", "-n", "0"], 2, "must be at least 1, got 0"),
        (
            ["convert", "{ckpt}", "{root}/st", "--to", "safetensors", "--max-shard-size", "lots"],
            2,
            "invalid size 'lots'",
        ),
        (["convert", "{ckpt}", "{root}/o", "--to", "onnx"], 2, "invalid choice: 'onnx'"),
        (["convert", "{ckpt}", "{root}/st", "--to", "safetensors", "--max-shard-size", "0MB"], 2, "must be positive"),
        (["convert", "{ckpt}", "{root}/o", "--to", "dcp", "--from", "dcp"], 2, "not allowed with argument"),
        (["convert", "{ckpt}", "{ckpt}", "--to", "dcp"], 2, "already exists; remove it or choose a new path"),
        (["convert", "{ckpt}", "{root}/o", "--from", "dcp"], 2, "not a torch.distributed.checkpoint directory"),
        (["convert", "{root}/nope.pt", "{root}/o", "--from", "torch"], 2, "nope.pt: no such file"),
        (["convert", "{ckpt}/manifest.json", "{root}/o", "--from", "torch"], 2, "is not a torch.save file"),
        (["convert", "{ckpt}", "{root}/o", "--to", "torch", "--prefix", "x."], 2, "starts with prefix 'x.'"),
        (["ls", "{root}/nope"], 2, "no such directory"),
        (["ls", "{storage}", "--run", "other"], 2, "no run 'other'"),
        (["inspect", "{ckpt}", "--tensor", "app.extra.step"], 2, "holds a plain value (7), not a tensor"),
        (["inspect", "{corrupt}", "--tensor", "app.model.w"], 1, "checksum mismatch in shard file"),
        (["verify", "{root}/bad_manifest"], 1, None),
        (["inspect"], 2, "the following arguments are required: CKPT"),
        (
            ["inspect", "{ckpt}", "--tensor", "app.model.ww"],
            2,
            "no tensor 'app.model.ww' in the checkpoint; did you mean 'app.model.w'",
        ),
        (["convert", "{ckpt}", "{root}/o"], 2, "one of the arguments --to --from is required"),
        ([], 2, "the following arguments are required: COMMAND"),
        (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    ],
)
def test_main_error_paths(capsys, world, argv, status, fragment):
    argv = [a.format(**world) for a in argv]
    code, out, err = main_lines(capsys, *argv)
    assert code == status, (out, err)
    if fragment is None:  # verify reports on stdout
        assert "not valid JSON" in out and out.splitlines()[-1].startswith("FAILED")
        return
    assert out == "" and len(err) == 1 and err[0].startswith("rayckpt: error: ") and fragment in err[0], err


def test_a_multi_line_error_becomes_one_line(capsys, world, tmp_path):
    path = tmp_path / "c"
    shutil.copytree(world["ckpt"], path)
    m = manifest_of(path)
    for e in m["entries"].values():
        for c in e.get("chunks", []):
            c["byte_length"] += 4
    write_manifest_doc(path, m)
    code, _, err = main_lines(capsys, "inspect", str(path))
    assert code == 1 and len(err) == 1
    assert "inconsistent manifest (" in err[0] and "problem(s)): key 'app.model" in err[0] and "; key" in err[0]


def test_an_os_error_is_exit_1(capsys, world, monkeypatch):
    def refuse(*_a, **_k):
        raise PermissionError(13, "Permission denied", "/somewhere")

    monkeypatch.setattr(tools, "inspect", refuse)
    code, _, err = main_lines(capsys, "inspect", world["ckpt"])
    assert code == 1 and err == ["rayckpt: error: [Errno 13] Permission denied: '/somewhere'"]


@pytest.mark.parametrize(
    "exc, status, line",
    [
        (
            FileNotFoundError(2, "No such file or directory", "/data/x"),
            2,
            "rayckpt: error: /data/x: no such file or directory",
        ),
        (KeyboardInterrupt(), 130, "rayckpt: interrupted"),
        (BrokenPipeError(), 0, None),
    ],
)
def test_other_failures(capsys, world, monkeypatch, exc, status, line):
    def fail(*_a, **_k):
        raise exc

    monkeypatch.setattr(tools, "inspect", fail)
    code, _, err = main_lines(capsys, "inspect", world["ckpt"])
    assert code == status and err == ([line] if line else [])


def test_help_and_version_exit_0(capsys):
    assert cli.main(["--help"]) == 0
    assert "convert" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rayckpt {rayckpt.__version__}"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_only_on_a_terminal():
    term = FakeTerminal()
    bar = cli.ProgressBar("verifying", stream=term, min_interval=0)
    bar(512, 2048)
    bar(2048, 2048)
    bar.close()
    text = term.getvalue()
    assert text.startswith("\rverifying [#######") and " 25% 512 B / 2.0 KiB" in text
    assert "[" + "#" * 30 + "] 100%" in text and text.endswith("\n")
    pipe = io.StringIO()
    quiet = cli.ProgressBar("verifying", stream=pipe)
    quiet(1, 2)
    quiet.close()
    assert pipe.getvalue() == ""


def test_sizes_parse_like_hugging_face():
    assert cli.parse_size("5GB") == 5 * 10**9
    assert cli.parse_size("500MiB") == 500 * 2**20
    assert cli.parse_size("1.5kb") == 1500
    assert cli.parse_size("4096") == 4096
