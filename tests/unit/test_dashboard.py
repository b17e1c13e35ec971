"""The Grafana dashboard generated from the metric definitions: a valid dashboard, queries that parse and name
only defined metrics and tags, global filters, installing it, and ``rayckpt dashboard export``."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest

from rayckpt.cli import commands as cli
from rayckpt.observe import dashboard, metric_defs
from rayckpt.ray.metadata import grafana
from tests.helpers.promql import names_and_labels, parse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Exported series name -> its definition.
EXPORTED = {
    m.exported(s): m
    for m in metric_defs.METRICS
    for s in (("bucket", "sum", "count") if m.kind == metric_defs.HISTOGRAM else ("",))
}
VARIABLES = ["datasource", "SessionName", "run", "node"]
FILTERS = ['ray_io_cluster="prod"', 'region=~"eu-.*"']


def all_panels(board: dict) -> list[dict]:
    out = []
    for p in board["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


# -- the dashboard ---------------------------------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_dashboard():
    board = json.loads(dashboard.dashboard_json([]))
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 27
    assert board["uid"] == "rayckpt" and board["title"] == "rayckpt checkpoints" and board["tags"] == ["rayckpt"]
    assert board["refresh"] == "10s" and board["time"] == {"from": "now-30m", "to": "now"}
    panels = all_panels(board)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids))
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) == len(dashboard.PANELS) and {p["type"] for p in graphs} == {"timeseries", "stat"}
    for p in panels:
        assert p["datasource"] == "${datasource}", p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    for p in graphs:
        assert p["description"] and p["targets"], p["title"]
        assert all(t["datasource"] == "${datasource}" and t["expr"] for t in p["targets"])
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    cells = [
        (p["gridPos"]["y"], x) for p in panels for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
    ]
    assert len(cells) == len(set(cells))  # no two panels overlap on a line they start on
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == VARIABLES
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["hide"] == 2
    for name in VARIABLES[1:]:
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["datasource"] == "${datasource}"
        assert v["query"] == v["definition"] and v["query"].startswith("label_values(")
        assert v["query"].endswith(f", {name})"), v["query"]
    assert variables["run"]["multi"] and variables["node"]["multi"] and not variables["SessionName"]["multi"]
    assert "ray_rayckpt_memory_held_bytes{" in variables["node"]["query"]


def test_units_come_from_the_metric_unless_the_panel_names_one():
    board = dashboard.dashboard([])
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in all_panels(board) if p["type"] != "row"}
    assert units["Save stall per rank (p50, p95)"] == metric_defs.metric("rayckpt_save_stall_seconds").unit == "s"
    assert units["Memory held per node against its budget"] == "bytes"
    assert units["Bytes written per tier"] == "bytes"
    assert units["Restores by tier"] == "short"  # a count of restore_seconds: the panel names its unit
    assert units["Checkpoint age now"] == units["Checkpoint age"] == "s"  # not the timestamp's dateTimeAsUnix


def test_every_query_parses():
    exprs = [e for *_, panel_exprs in dashboard.panels(FILTERS) for e in panel_exprs]
    assert len(exprs) >= len(dashboard.PANELS)
    for expr in exprs:
        parse(expr)
    for v in dashboard.dashboard(FILTERS)["templating"]["list"][1:]:  # label_values(SELECTOR, label)
        parse(re.fullmatch(r"label_values\((.*), \w+\)", v["query"]).group(1))


@pytest.mark.parametrize(
    "broken",
    [
        'sum by (run (rate(ray_rayckpt_bytes_written_total{run=~"$run"}[$__rate_interval]))',
        'max by (run) (ray_rayckpt_saves_in_flight{run=~"$run"',
        "histogram_quantile(0.5, rate(ray_rayckpt_commit_seconds_bucket[$__rate_interval]) +)",
    ],
)
def test_the_parse_check_fails_on_a_broken_query(broken):
    with pytest.raises(ValueError):
        parse(broken)


def test_queries_name_only_defined_metrics_and_their_tags():
    allowed_extra = {*dashboard.RAY_LABELS, "ray_io_cluster", "region"}
    seen = set()
    for row, title, _, exprs in dashboard.panels(FILTERS):
        for expr in exprs:
            names, labels = names_and_labels(expr)
            names -= set(dashboard.PROMETHEUS_SERIES)
            assert names and names <= set(EXPORTED), (title, names - set(EXPORTED))
            assert set(re.findall(r"ray_rayckpt_\w+", expr)) == names  # the text names nothing the AST missed
            for name in names:
                m = EXPORTED[name]
                own = set(m.tags) | ({"le"} if name.endswith("_bucket") else set())
                assert labels <= own | allowed_extra, (row, title, labels - own - allowed_extra)
                seen.add(m.name)
            assert "SessionName" in labels
            for tag in ("run", "node"):
                if any(tag in EXPORTED[n].tags for n in names):
                    assert f'{tag}=~"${tag}"' in expr, (title, expr)
    assert {"rayckpt_save_stall_seconds", "rayckpt_last_commit_timestamp_seconds", "rayckpt_restored_bytes"} <= seen


def test_the_label_check_sees_an_unknown_label():
    names, labels = names_and_labels('sum by (host) (rate(ray_rayckpt_bytes_written_total{run=~"$run"}[1m]))')
    assert names == {"ray_rayckpt_bytes_written_total"} and "host" in labels
    assert not labels <= set(metric_defs.metric("rayckpt_bytes_written").tags) | {"SessionName"}


@pytest.mark.parametrize("name", ["rayckpt_restored_bytes", "rayckpt_last_commit_timestamp_seconds"])
def test_a_dropped_metric_fails_generation_naming_it(monkeypatch, name):
    monkeypatch.delitem(metric_defs.BY_NAME, name)
    with pytest.raises(KeyError, match=name):
        dashboard.dashboard([])
    with pytest.raises(KeyError, match=name):
        dashboard.panels([])


def test_a_dropped_tag_fails_generation(monkeypatch):
    m = metric_defs.metric("rayckpt_save_stall_seconds")
    monkeypatch.setitem(
        metric_defs.BY_NAME,
        m.name,
        metric_defs.MetricDef(name=m.name, kind=m.kind, description=m.description, tags=("run",)),
    )
    with pytest.raises(ValueError, match="rayckpt_save_stall_seconds"):
        dashboard.dashboard([])


def test_global_filters_from_the_environment_land_in_every_query(monkeypatch):
    monkeypatch.setenv("RAY_GRAFANA_RAYCKPT_DASHBOARD_GLOBAL_FILTERS", ",".join(FILTERS))
    board = dashboard.dashboard()
    targets = [t for p in all_panels(board) for t in p.get("targets", [])]
    queries = [t["expr"] for t in targets] + [v["query"] for v in board["templating"]["list"][1:]]
    for q in queries:
        assert all(f in q for f in FILTERS), q
    assert dashboard.dashboard([]) != board
    monkeypatch.delenv("RAY_GRAFANA_RAYCKPT_DASHBOARD_GLOBAL_FILTERS")
    assert dashboard.dashboard() == dashboard.dashboard([])
    assert not any("ray_io_cluster" in e for *_, exprs in dashboard.panels() for e in exprs)


def test_panels_are_listed_with_a_question_each():
    listed = dashboard.panels([])
    assert [(r, t) for r, t, *_ in listed] == [(p.row, p.title) for p in dashboard.PANELS]
    assert len({t for _, t, *_ in listed}) == len(listed)
    rows = list(dict.fromkeys(r for r, *_ in listed))
    assert rows[:4] == ["Saves", "Checkpoint age", "Memory tier", "Restores"]
    for _, title, description, exprs in listed:
        assert description.endswith(".")
        assert exprs, title
    age = [d for r, _, d, _ in listed if r == "Checkpoint age"]
    assert any("ray_rayckpt_checkpoint_age_seconds" in d for d in age)


# -- installing it ---------------------------------------------------------------------------------------------


def test_install_twice_leaves_one_file_with_the_same_bytes(tmp_path):
    folder = tmp_path / "made" / "dashboards"
    path = dashboard.install(str(folder), [])
    first = open(path, "rb").read()
    assert dashboard.install(str(folder), []) == path == str(folder / "rayckpt_grafana_dashboard.json")
    assert os.listdir(folder) == ["rayckpt_grafana_dashboard.json"]
    assert open(path, "rb").read() == first and json.loads(first)["uid"] == "rayckpt"


@pytest.mark.parametrize("how", ["refusing new files", "under a file"])
def test_install_where_it_cannot_write_raises_oserror(tmp_path, how):
    if how == "refusing new files":  # /proc takes no new file, not even from root (a read-only mode would)
        folder = "/proc/self/rayckpt-dashboards"
        with pytest.raises(OSError):
            dashboard.install(folder)
        assert not os.path.exists(folder)
        return
    else:
        (tmp_path / "a-file").write_text("")
        folder = tmp_path / "a-file" / "dashboards"
    with pytest.raises(OSError):
        dashboard.install(str(folder))
    assert not os.path.exists(folder) or os.listdir(folder) == []


def test_dashboards_folder_is_where_ray_s_metrics_head_writes(monkeypatch):
    monkeypatch.delenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", raising=False)
    monkeypatch.delenv("RAY_METRICS_OUTPUT_ROOT", raising=False)
    assert dashboard.dashboards_folder("/s") == "/s/metrics/grafana/dashboards"
    monkeypatch.setenv("RAY_METRICS_OUTPUT_ROOT", "/m")
    assert dashboard.dashboards_folder("/s") == "/m/grafana/dashboards"
    monkeypatch.setenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", "/d")
    assert dashboard.dashboards_folder("/s") == "/d"


def test_install_dashboard_logs_a_warning_and_returns_none_when_it_cannot_write(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", raising=False)
    monkeypatch.delenv("RAY_METRICS_OUTPUT_ROOT", raising=False)
    (tmp_path / "session").write_text("")  # a file where the session directory should be
    monkeypatch.setattr(grafana, "session_dir", lambda: str(tmp_path / "session"))
    with caplog.at_level(logging.INFO):
        assert grafana.install_dashboard() is None
    records = [r for r in caplog.records if "dashboard" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING], records


def test_install_dashboard_writes_into_the_session_s_grafana_folder(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", raising=False)
    monkeypatch.delenv("RAY_METRICS_OUTPUT_ROOT", raising=False)
    monkeypatch.setattr(grafana, "session_dir", lambda: str(tmp_path))
    with caplog.at_level(logging.INFO):
        path = grafana.install_dashboard()
    assert path == str(tmp_path / "metrics" / "grafana" / "dashboards" / "rayckpt_grafana_dashboard.json")
    assert json.load(open(path))["uid"] == "rayckpt"
    records = [r for r in caplog.records if "dashboard" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.INFO] and path in records[0].getMessage()


def test_install_dashboard_soon_never_raises(monkeypatch):
    def boom():
        raise RuntimeError("no session")

    monkeypatch.setattr(grafana, "session_dir", boom)
    monkeypatch.setattr(grafana, "WAIT_FOR_RAY_S", 0.0)
    grafana.install_dashboard_soon()  # the failure is the thread's WARNING, not the caller's


# -- rayckpt dashboard export ----------------------------------------------------------------------------------


def rayckpt_cmd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rayckpt", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_export_writes_the_dashboard(tmp_path, capsys):
    path = str(tmp_path / "d.json")
    assert cli.main(["dashboard", "export", path, "--json"]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out) == {"path": path, "panels": len(dashboard.PANELS)}
    assert json.load(open(path)) == dashboard.dashboard()
    assert cli.main(["dashboard", "export", path]) == cli.EXIT_OK
    assert path in capsys.readouterr().out and os.listdir(tmp_path) == ["d.json"]


def test_export_to_stdout_and_its_errors(tmp_path):
    r = rayckpt_cmd("dashboard", "export", "-")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads(r.stdout)["uid"] == "rayckpt"
    (tmp_path / "a-file").write_text("")
    bad = str(tmp_path / "a-file" / "d.json")
    r = rayckpt_cmd("dashboard", "export", bad)
    assert r.returncode == cli.EXIT_FAILED and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayckpt: error: ") and bad in lines[0], r.stderr
    r = rayckpt_cmd("dashboard")
    assert r.returncode == cli.EXIT_USAGE and len(r.stderr.splitlines()) == 1, r.stderr


INCREASED_TEST = """
rule_files: []
evaluation_interval: 15s
tests:
  - interval: 15s
    input_series:
      - series: 'up{instance="a"}'
        values: '1x40'
      # born at its first event (a restore) at 3m, after Prometheus had scraped its target for 3 minutes
      - series: 'x_total{instance="a", run="r"}'
        values: '_x12 1x28'
      # there since Prometheus's first scrape: its history is not counted as new
      - series: 'x_total{instance="a", run="old"}'
        values: '5x40'
    promql_expr_test:
      - expr: 'sum by (run) (EXPR)'
        eval_time: 3m30s
        exp_samples:
          - labels: '{run="r"}'
            value: 1
          - labels: '{run="old"}'
            value: 0
      - expr: 'sum by (run) (EXPR)'
        eval_time: 6m
        exp_samples:
          - labels: '{run="r"}'
            value: 0
          - labels: '{run="old"}'
            value: 0
      - expr: 'sum by (run) (EXPR)'
        eval_time: 30s
        exp_samples:
          - labels: '{run="old"}'
            value: 0
"""


@pytest.mark.parametrize("how", ["increased", "increase"])
def test_a_series_born_at_its_first_event_counts_it_and_one_new_only_to_prometheus_does_not(tmp_path, how):
    """``increased`` evaluated by Prometheus's own engine (``promtool test rules``): a counter whose first
    sample holds its one event shows it; ``increase()`` alone does not (the check that this test can fail)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found: apt-get install prometheus (Debian), or put Prometheus's promtool on PATH")
    expr = dashboard.increased('x_total{run=~".*"}', "1m") if how == "increased" else "increase(x_total[1m])"
    test = tmp_path / "increased_test.yml"
    test.write_text(INCREASED_TEST.replace("EXPR", expr))
    done = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    if how == "increased":
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        out = done.stdout + done.stderr
        assert done.returncode != 0 and 'got: {run="old"} 0E+00, {run="r"} 0E+00' in out, out
