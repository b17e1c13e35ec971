"""What a user watching a run sees: rank 0's save lines, the metric table of docs/observability.md, the
demo's and train.sh's cleanup of what they leave on disk."""

from __future__ import annotations

import io
import os
import subprocess
import tempfile
import time

import pytest

from rayckpt.examples import demo
from rayckpt.observe.metric_defs import BY_NAME, METRICS
from rayckpt.storage.catalog import CatalogEntry
from rayckpt.train.announce import SaveAnnouncer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def entry(status: str, nbytes: int = 3 * 2**20, error: str | None = None) -> CatalogEntry:
    return CatalogEntry(
        run="gpt",
        step=5,
        path="/ckpts/gpt/rayckpt-step-00000005",
        status=status,
        created=0.0,
        world_size=4,
        bytes=nbytes,
        save_id="s-1",
        error=error,
    )


def test_rank_0_announces_each_commit_once():
    out = io.StringIO()
    announcer = SaveAnnouncer("gpt", 0, out)
    announcer.announce("s-1", 5, entry("committed"), seconds=1.234)
    announcer.announce("s-1", 5, entry("committed"), seconds=1.234)  # the upload thread and wait() both learned it
    assert out.getvalue().splitlines() == ["rayckpt: gpt committed step 5 (3.0 MiB, 1.23 s)"]


def test_the_commit_line_prints_the_metadata_actor_s_time_and_leaves_it_out_when_unknown():
    out = io.StringIO()
    announcer = SaveAnnouncer("gpt", 0, out)
    announcer.announce("s-1", 5, entry("committed"), seconds=0.5)
    announcer.announce("s-2", 5, entry("committed"))  # storage answered: the actor that timed it is gone
    assert out.getvalue().splitlines() == [
        "rayckpt: gpt committed step 5 (3.0 MiB, 0.50 s)",
        "rayckpt: gpt committed step 5 (3.0 MiB)",
    ]


def test_failures_are_announced_with_their_error():
    out = io.StringIO()
    announcer = SaveAnnouncer("gpt", 0, out)
    announcer.announce("s-1", 5, entry("failed", error="rank 2: No space left on device"))
    announcer.announce("s-2", 10, error="save of step 10 failed; nothing was committed: boom")
    assert out.getvalue().splitlines() == [
        "rayckpt: gpt failed to save step 5, nothing committed: rank 2: No space left on device",
        "rayckpt: gpt failed to save step 10, nothing committed: save of step 10 failed; nothing was committed: boom",
    ]


def test_other_ranks_stay_quiet():
    out = io.StringIO()
    SaveAnnouncer("gpt", 1, out).announce("s-1", 5, entry("committed"), seconds=1.0)
    assert out.getvalue() == ""


def observability_page() -> str:
    with open(os.path.join(ROOT, "docs", "observability.md"), encoding="utf-8") as f:
        return f.read()


def table_rows(section: str) -> list[list[str]]:
    """The cells of each row of the Markdown tables in ``section`` (headers and rules left out)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()]
    return [r for r in rows if len(r) == 3 and r[0] not in ("row", "metric") and not r[0].startswith("---")]


def test_docs_metric_table_lists_every_metric_with_its_tags_in_order():
    page = observability_page()
    section = page[page.index("## Metrics") : page.index("## `rayckpt status`")]
    rows = [(r[0].strip("`"), tuple(t.strip("` ") for t in r[1].split(","))) for r in table_rows(section)]
    assert rows == [(m.name, m.tags) for m in METRICS]
    assert BY_NAME["rayckpt_bytes_read"].tags == ("run", "rank")


def test_docs_panel_table_is_the_dashboard_s():
    from rayckpt.observe import dashboard

    page = observability_page()
    start = page.index("## Grafana: the rayckpt dashboard")
    section = page[start : page.index("\n## ", start)]
    assert [tuple(r) for r in table_rows(section)] == [(row, t, d) for row, t, d, _ in dashboard.panels([])]


def test_demo_removes_its_temp_dir_on_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def broken(*args, **kwargs):
        raise RuntimeError("rank 1 died")

    monkeypatch.setattr(demo, "run_ranks", broken)
    with pytest.raises(RuntimeError, match="rank 1 died"):
        demo.main(["--save-ranks", "2", "--load-ranks", "1"])
    assert os.listdir(tmp_path) == []


def test_demo_help_tells_what_it_shows(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    text = capsys.readouterr().out
    assert "Outputs MATCH" in text and "--save-ranks" in text and "removed" in text


def make_runs(root, names: list[str]) -> None:
    """Directories named ``names``, oldest first (modification times an hour apart)."""
    now = time.time()
    for i, name in enumerate(names):
        os.makedirs(root / name)
        t = now - 3600 * (len(names) - i)
        os.utime(root / name, (t, t))


def prune(root, keep: str) -> subprocess.CompletedProcess:
    script = os.path.join(ROOT, "scripts", "prune_runs.sh")
    return subprocess.run(["bash", script, str(root), keep], capture_output=True, text=True, check=False)


def test_prune_runs_keeps_the_most_recent_auto_named_runs(tmp_path):
    auto = ["gpt-20260101-000001", "gpt-20260101-000002", "gpt-20260101-000003", "gpt-20260101-000004"]
    make_runs(tmp_path, ["my-run", auto[0], "gpt-old-style", *auto[1:]])
    (tmp_path / "gpt-20260101-000000").write_text("a file, not a run")
    recent = time.time()
    os.utime(tmp_path / auto[0], (recent, recent))  # resumed lately: kept although named first
    done = prune(tmp_path, "2")
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["my-run", "gpt-old-style", auto[0], auto[3], "gpt-20260101-000000"])
    assert done.stderr.count("removing old run") == 2


def test_prune_runs_refuses_a_bad_count(tmp_path):
    make_runs(tmp_path, ["gpt-20260101-000001"])
    done = prune(tmp_path, "-1")
    assert done.returncode == 2 and "KEEP must be a whole number, got '-1'" in done.stderr
    assert os.listdir(tmp_path) == ["gpt-20260101-000001"]


def test_train_sh_refuses_a_bad_keep_count_before_anything_else():
    env = {**os.environ, "RAYCKPT_KEEP_RUNS": "three"}
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "train.sh")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 2
    assert "RAYCKPT_KEEP_RUNS must be a whole number (0 keeps every run), got 'three'" in done.stderr


def test_checkpointer_wait_announces_the_outcome_it_learns(monkeypatch):
    """With ``report=False`` nobody waits in Ray Train's upload thread: ``wait()`` (also the
    first thing ``save()`` does) announces the last save's outcome, whether it returns or raises."""
    from types import SimpleNamespace

    from rayckpt.errors import SaveFailedError
    from rayckpt.train import checkpointer

    out = io.StringIO()
    ckpt = object.__new__(checkpointer.Checkpointer)  # no Ray Train context: only wait() is used
    ckpt.announcer = SaveAnnouncer("gpt", 0, out)
    ckpt.memory, ckpt.memory_announcer = SimpleNamespace(run="gpt@memory"), SaveAnnouncer("gpt (memory)", 0, out)
    ckpt._last = {
        "storage": (SimpleNamespace(save_id="s-1", step=5, run="gpt", commit_seconds=0.25), time.perf_counter())
    }
    monkeypatch.setattr(checkpointer, "wait_inflight", lambda lane: entry("committed"))
    assert ckpt.wait().status == "committed"

    def failing(lane):
        if lane == "default":
            raise SaveFailedError("save of step 10 to /ckpts (save s-2) failed; nothing was committed: boom")
        return entry("committed")

    ckpt._last = {
        "memory": (SimpleNamespace(save_id="s-1", step=6, run="gpt@memory", commit_seconds=1.5), time.perf_counter())
    }
    assert ckpt.wait().status == "committed"  # a memory save's line names the tier

    ckpt._last = {
        "storage": (SimpleNamespace(save_id="s-2", step=10, run="gpt", commit_seconds=None), time.perf_counter())
    }
    monkeypatch.setattr(checkpointer, "wait_inflight", failing)
    with pytest.raises(SaveFailedError, match="boom"):
        ckpt.wait()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[0] == "rayckpt: gpt committed step 5 (3.0 MiB, 0.25 s)"
    assert lines[1] == "rayckpt: gpt (memory) committed step 6 (3.0 MiB, 1.50 s)"  # the actor's time
    assert lines[2] == (
        "rayckpt: gpt failed to save step 10, nothing committed: "
        "save of step 10 to /ckpts (save s-2) failed; nothing was committed: boom"
    )


def test_prune_runs_breaks_ties_by_the_time_in_the_name(tmp_path):
    names = ["gpt-20260101-000001", "gpt-20260101-000003", "gpt-20260101-000002"]
    for name in names:
        os.makedirs(tmp_path / name)
        os.utime(tmp_path / name, (1e9, 1e9))  # the same second
    assert prune(tmp_path, "1").returncode == 0
    assert os.listdir(tmp_path) == ["gpt-20260101-000003"]
