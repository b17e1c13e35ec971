"""``rayckpt status``'s command line without a cluster: what it prints and exits with for each answer the cluster
side (``rayckpt.ray.status.reader``, replaced here) gives. Against a live cluster: ``tests/ray/test_status.py``."""

from __future__ import annotations

import json
import time
import types

import pytest

from rayckpt.cli import commands as cli
from rayckpt.cli import status as cli_status
from rayckpt.ray.joining import ClusterUnreachableError
from rayckpt.ray.status import reader as status

NOW = 1_000_000.0
REPORT = {
    "time": NOW,
    "now": NOW,
    "pid": 7,
    "published_age_s": 0.2,
    "runs": [
        {
            "run": "gpt",
            "tiers": {
                "storage": {"step": 4, "path": "/c/gpt/rayckpt-step-00000004", "committed_at": NOW - 9, "age_s": 9}
            },
            "in_flight": [],
            "failures": [],
            "restores": [],
            "restarts": 0,
            "fallbacks": 0,
        }
    ],
    "nodes": [],
}


@pytest.fixture
def cluster(monkeypatch):
    """A cluster that answers with ``REPORT``; ``asked`` counts the reads."""
    asked = []
    monkeypatch.setattr(status, "join", lambda address: address or "10.0.0.1:6379")
    monkeypatch.setattr(status, "gather", lambda: asked.append(1) or json.loads(json.dumps(REPORT)))
    return asked


def test_the_screen_and_exit_0(cluster, capsys):
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rayckpt status at 10.0.0.1:6379, ") and "storage  newest step 4, committed 9.0 s ago" in out


def test_json(cluster, capsys):
    assert cli.main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["tiers"]["storage"]["step"] == 4


def test_watch_prints_again_until_ctrl_c(cluster, capsys, monkeypatch):
    naps = []

    def sleep(seconds):
        naps.append(seconds)
        if len(naps) >= 2:
            raise KeyboardInterrupt

    # The command's own clock only: patching ``time.sleep`` itself would also count (and interrupt) the naps of
    # any other thread alive in this process.
    clock = types.SimpleNamespace(sleep=sleep, strftime=time.strftime, localtime=time.localtime)
    monkeypatch.setattr(cli_status, "time", clock)
    assert cli.main(["status", "--watch", "3"]) == 0
    assert naps == [3, 3] and len(cluster) == 2
    assert capsys.readouterr().out.count("rayckpt status at ") == 2


@pytest.mark.parametrize("bad", ["0", "-1", "x"])
def test_a_bad_watch_is_a_usage_error(bad, capsys):
    assert cli.main(["status", "--watch", bad]) == 2
    assert "--watch" in capsys.readouterr().err


def test_no_cluster_is_one_line_and_exit_1(monkeypatch, capsys):
    def unreachable(address):
        raise ClusterUnreachableError(f"the Ray cluster at {address} (from --address) does not answer within 3 s")

    monkeypatch.setattr(status, "join", unreachable)
    assert cli.main(["status", "--address", "10.9.9.9:6379"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rayckpt status: the Ray cluster at 10.9.9.9:6379 (from --address) does not answer within 3 s"]


def test_no_rayckpt_is_one_line_and_exit_1(monkeypatch, capsys):
    def none():
        raise status.NoRayckptError("no rayckpt on this Ray cluster")

    monkeypatch.setattr(status, "join", lambda address: "10.0.0.1:6379")
    monkeypatch.setattr(status, "gather", none)
    assert cli.main(["status"]) == 1
    assert capsys.readouterr().err.strip() == "rayckpt status: no rayckpt on this Ray cluster"


def test_plot_draws_the_last_active_run_or_says_why_not(cluster, monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    asked = []
    save = {"save_id": "a", "tier": "storage", "step": 4, "begun": NOW, "registered": NOW, "staged": None}
    save.update(written=None, ranks_written=0, stall=None, settled=NOW + 1, status="committed")
    monkeypatch.setattr(
        status, "timeline", lambda run: asked.append(run) or {"run": run, "saves": [save], "events": []}
    )
    path = tmp_path / "t.png"
    assert cli.main(["status", "--plot", str(path)]) == 0
    assert asked == ["gpt"] and path.read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.strip() == f"wrote {path}: 1 saves of run gpt"

    monkeypatch.setattr(status, "timeline", lambda run: {"run": run, "saves": [], "events": []})
    assert cli.main(["status", "--plot", str(tmp_path / "x.png"), "--run", "other"]) == 1
    assert capsys.readouterr().err.strip() == "rayckpt status: run 'other' has no save on record to draw"
    monkeypatch.setattr(status, "timeline", lambda run: {"run": run, "saves": [save], "events": []})
    assert cli.main(["status", "--plot", str(tmp_path / "no-such-dir" / "x.png")]) == 1
    assert capsys.readouterr().err.startswith(f"rayckpt status: cannot write {tmp_path / 'no-such-dir' / 'x.png'}: ")
