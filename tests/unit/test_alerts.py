"""The Prometheus alert rules on checkpoint age: the rule file promtool accepts, the alerts firing (and not)
under ``promtool test rules``, global filters, the duration parser, and ``rayckpt dashboard alerts``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from rayckpt.cli import commands as cli
from rayckpt.observe import alerts
from rayckpt.observe.dashboard import GLOBAL_FILTERS_ENV

MAX_AGE_S = 1800.0  # 30m
STAMP = "ray_rayckpt_last_commit_timestamp_seconds"
ACTIVE = "ray_rayckpt_run_active"
PROD = 'ray_io_cluster="prod"'


@pytest.fixture(autouse=True)
def _no_env_filters(monkeypatch):
    monkeypatch.delenv(GLOBAL_FILTERS_ENV, raising=False)


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool not found: apt-get install prometheus (Debian) "
            "or put Prometheus's promtool on PATH to run this test"
        )
    return path


# -- the rules --------------------------------------------------------------------------------------------------


def test_the_alert_expressions():
    too_old, none = alerts.rules(MAX_AGE_S, global_filters=[])
    assert (too_old.name, none.name) == ("RayckptCheckpointTooOld", "RayckptNoCheckpoint")
    assert too_old.expr == (
        f"(time() - max by (SessionName, run, tier) ({STAMP}) > 1800) "
        f"and on (SessionName, run) (max by (SessionName, run) ({ACTIVE}) > 0)"
    )
    assert none.expr == (
        f"(max by (SessionName, run) ({ACTIVE}) > 0) unless on (SessionName, run) (max by (SessionName, run) ({STAMP}))"
    )
    assert (too_old.for_s, none.for_s) == (0.0, MAX_AGE_S)


def test_the_rule_file():
    doc = yaml.safe_load(alerts.rules_yaml(5400, for_s=120, global_filters=[]))
    [group] = doc["groups"]
    assert group["name"] == "rayckpt"
    assert [r["alert"] for r in group["rules"]] == ["RayckptCheckpointTooOld", "RayckptNoCheckpoint"]
    assert [r["for"] for r in group["rules"]] == ["2m", "1h30m"]
    for r in group["rules"]:
        assert r["labels"] == {"severity": "warning"}
        assert (
            set(r["annotations"]) == {"summary", "description"} and "{{ $labels.run }}" in r["annotations"]["summary"]
        )
    assert "> 5400)" in group["rules"][0]["expr"]
    assert "{{ $value | humanizeDuration }}" in group["rules"][0]["annotations"]["description"]


def test_every_selector_carries_the_global_filters(monkeypatch):
    for filters in ([PROD, 'region="eu"'], None):
        if filters is None:
            monkeypatch.setenv(GLOBAL_FILTERS_ENV, f' {PROD}, region="eu" ')
        for rule in alerts.rules(MAX_AGE_S, global_filters=filters):
            selectors = re.findall(r"ray_rayckpt_\w+(\{[^}]*\})?", rule.expr)
            assert len(selectors) == 2 and set(selectors) == {f'{{{PROD}, region="eu"}}'}, rule.expr
    monkeypatch.delenv(GLOBAL_FILTERS_ENV)
    assert "{" not in "".join(r.expr for r in alerts.rules(MAX_AGE_S))


@pytest.mark.parametrize(
    "max_age_s, for_s", [(0, 0), (-60, 0), (0.0004, 0), (float("nan"), 0), (float("inf"), 0), (60, -1)]
)
def test_bad_thresholds_are_refused(max_age_s, for_s):
    with pytest.raises(ValueError, match="must be a finite number of seconds"):
        alerts.rules(max_age_s, for_s=for_s, global_filters=[])


# -- durations --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90s", 90),
        ("30m", 1800),
        ("1h30m", 5400),
        ("2h", 7200),
        ("1d", 86400),
        ("1w", 604800),
        ("1d2h3m4s", 93784),
        ("500ms", 0.5),
        ("1m30s500ms", 90.5),
        ("0s", 0),
        ("90", 90),
        ("1.5", 1.5),
        ("0", 0),
        (" 30m ", 1800),
    ],
)
def test_parse_duration(text, seconds):
    assert alerts.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["abc", "", "-5m", "-5", "1m1h", "30 m", "1.5h", "m", "30M", "1e3"])
def test_parse_duration_names_the_bad_text_and_the_form(text):
    with pytest.raises(ValueError) as caught:
        alerts.parse_duration(text)
    assert str(caught.value) == (
        f"invalid duration {text!r}: "
        "use a Prometheus duration such as 90s, 30m, 1h30m, 2h or 1d, or a number of seconds"
    )


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0s"), (90, "1m30s"), (1800, "30m"), (5400, "1h30m"), (86400, "1d"), (90061.5, "1d1h1m1s500ms")],
)
def test_format_duration(seconds, text):
    assert alerts.format_duration(seconds) == text
    assert alerts.parse_duration(text) == seconds


# -- promtool ---------------------------------------------------------------------------------------------------


def test_promtool_checks_the_rule_file(promtool, tmp_path):
    for name, filters in (("plain.yml", []), ("filtered.yml", [PROD, 'region=~"eu-.*"'])):
        path = tmp_path / name
        path.write_text(alerts.rules_yaml(MAX_AGE_S, for_s=60, global_filters=filters))
        r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "SUCCESS: 2 rules found" in r.stdout, r.stdout + r.stderr


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    """An input series of a promtool test: one sample a minute (``0+0x60``: the value 0, 61 times)."""
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def expected(alert: str, value: str = "", **labels: str) -> dict:
    """An alert promtool should see: its labels and its annotations rendered as Prometheus renders them
    (``value``: what ``humanizeDuration`` makes of the alert's value)."""
    [rule] = [r for r in alerts.rules(MAX_AGE_S, global_filters=[]) if r.name == alert]

    def render(template: str) -> str:
        for name, v in labels.items():
            template = template.replace(f"{{{{ $labels.{name} }}}}", v)
        return template.replace("{{ $value | humanizeDuration }}", value)

    return {
        "exp_labels": {**labels, "severity": "warning"},
        "exp_annotations": {"summary": render(rule.summary), "description": render(rule.description)},
    }


def evals(alert: str, at: dict[str, list[dict]]) -> list[dict]:
    return [{"eval_time": t, "alertname": alert, "exp_alerts": exp} for t, exp in at.items()]


def promtool_test(promtool: str, tmp_path, inputs: list[dict], checks: list[dict], filters=()):
    (tmp_path / "rules.yml").write_text(alerts.rules_yaml(MAX_AGE_S, global_filters=list(filters)))
    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": checks}],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    return subprocess.run(
        [promtool, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def assert_passes(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0 and "SUCCESS" in r.stdout + r.stderr, r.stdout + r.stderr


def test_an_old_checkpoint_of_an_active_run_fires_once_past_max_age(promtool, tmp_path):
    # The storage checkpoint committed at time 0; the memory one commits every minute (never old).
    inputs = [
        series(STAMP, "0+0x60", SessionName="s", run="a", tier="storage"),
        series(STAMP, "0+60x60", SessionName="s", run="a", tier="memory"),
        series(ACTIVE, "1+0x60", SessionName="s", run="a"),
    ]
    old = dict(SessionName="s", run="a", tier="storage")
    checks = evals(
        "RayckptCheckpointTooOld",
        {
            "29m": [],
            "30m": [],  # 1800 s old: not more than max_age yet
            "31m": [expected("RayckptCheckpointTooOld", "31m 0s", **old)],
            "45m": [expected("RayckptCheckpointTooOld", "45m 0s", **old)],
        },
    )
    checks += evals("RayckptNoCheckpoint", {"45m": []})
    r = promtool_test(promtool, tmp_path, inputs, checks)
    assert_passes(r)
    rendered = checks[2]["exp_alerts"][0]["exp_annotations"]["description"]
    assert "checkpoint of run a (Ray session s) committed 31m 0s ago, more than 30m" in rendered


def test_a_fresh_checkpoint_does_not_fire(promtool, tmp_path):
    inputs = [
        series(STAMP, "0+60x60", SessionName="s", run="a", tier="storage"),  # commits every minute
        series(ACTIVE, "1+0x60", SessionName="s", run="a"),
    ]
    checks = evals("RayckptCheckpointTooOld", {"40m": [], "60m": []}) + evals("RayckptNoCheckpoint", {"40m": []})
    assert_passes(promtool_test(promtool, tmp_path, inputs, checks))


def test_a_finished_run_s_old_checkpoint_does_not_fire(promtool, tmp_path):
    inputs = [
        series(STAMP, "0+0x60", SessionName="s", run="gone", tier="storage"),  # no run_active at all
        series(STAMP, "0+0x60", SessionName="s", run="ended", tier="storage"),
        series(ACTIVE, "1+0x10", SessionName="s", run="ended"),  # rank 0 went at 10m
    ]
    checks = evals("RayckptCheckpointTooOld", {"40m": [], "60m": []}) + evals("RayckptNoCheckpoint", {"40m": []})
    assert_passes(promtool_test(promtool, tmp_path, inputs, checks))


def test_an_active_run_without_a_checkpoint_fires_after_max_age(promtool, tmp_path):
    inputs = [
        series(ACTIVE, "1+0x60", SessionName="s", run="bare"),
        series(ACTIVE, "1+0x60", SessionName="s", run="saved"),
        series(STAMP, "0+60x60", SessionName="s", run="saved", tier="memory"),
    ]
    fired = [expected("RayckptNoCheckpoint", SessionName="s", run="bare")]
    checks = evals("RayckptNoCheckpoint", {"10m": [], "29m": [], "31m": fired, "50m": fired})
    assert_passes(promtool_test(promtool, tmp_path, inputs, checks))


def test_series_outside_the_global_filters_do_not_fire(promtool, tmp_path):
    inputs = [
        series(STAMP, "0+0x60", SessionName="p", run="a", tier="storage", ray_io_cluster="prod"),
        series(ACTIVE, "1+0x60", SessionName="p", run="a", ray_io_cluster="prod"),
        series(STAMP, "0+0x60", SessionName="d", run="b", tier="storage", ray_io_cluster="dev"),
        series(ACTIVE, "1+0x60", SessionName="d", run="b", ray_io_cluster="dev"),
        series(ACTIVE, "1+0x60", SessionName="d", run="c", ray_io_cluster="dev"),  # no checkpoint, wrong cluster
    ]
    prod = expected("RayckptCheckpointTooOld", "31m 0s", SessionName="p", run="a", tier="storage")
    checks = evals("RayckptCheckpointTooOld", {"31m": [prod]}) + evals("RayckptNoCheckpoint", {"40m": []})
    assert_passes(promtool_test(promtool, tmp_path, inputs, checks, filters=[PROD]))


def test_a_wrong_expectation_fails(promtool, tmp_path):
    # The harness can fail: the alert of the first test expected with the wrong tier, and expected too early.
    inputs = [
        series(STAMP, "0+0x60", SessionName="s", run="a", tier="storage"),
        series(ACTIVE, "1+0x60", SessionName="s", run="a"),
    ]
    wrong_tier = expected("RayckptCheckpointTooOld", "45m 0s", SessionName="s", run="a", tier="memory")
    too_early = expected("RayckptCheckpointTooOld", "29m 0s", SessionName="s", run="a", tier="storage")
    for at, alert in (("45m", wrong_tier), ("29m", too_early)):
        r = promtool_test(promtool, tmp_path, inputs, evals("RayckptCheckpointTooOld", {at: [alert]}))
        assert r.returncode == 1 and "FAILED" in r.stdout + r.stderr, r.stdout + r.stderr


# -- rayckpt dashboard alerts -----------------------------------------------------------------------------------


def main(capsys, *argv: str) -> tuple[int, str, list[str]]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err.splitlines()


def test_alerts_writes_the_rule_file(tmp_path, capsys):
    path = str(tmp_path / "rayckpt-alerts.yml")
    code, out, err = main(capsys, "dashboard", "alerts", path)
    assert (code, err) == (cli.EXIT_OK, [])
    assert out == (
        f"wrote the rayckpt Prometheus alert rules (2 alerts: a live run's checkpoint older than 30m) to {path}\n"
    )
    assert open(path).read() == alerts.rules_yaml(MAX_AGE_S)
    code, out, _ = main(capsys, "dashboard", "alerts", path, "--max-age", "1h30m", "--for", "2m")
    assert code == cli.EXIT_OK and "older than 1h30m" in out
    assert open(path).read() == alerts.rules_yaml(5400, for_s=120)
    assert os.listdir(tmp_path) == ["rayckpt-alerts.yml"]  # written through a temporary file, none left


def test_alerts_to_stdout_and_as_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(GLOBAL_FILTERS_ENV, PROD)
    code, out, err = main(capsys, "dashboard", "alerts", "-", "--max-age", "90")
    assert (code, err) == (cli.EXIT_OK, []) and out == alerts.rules_yaml(90)
    assert f"{STAMP}{{{PROD}}}" in out
    path = str(tmp_path / "a.yml")
    code, out, err = main(capsys, "dashboard", "alerts", path, "--max-age", "1h30m", "--json")
    assert (code, err) == (cli.EXIT_OK, [])
    assert json.loads(out) == {"path": path, "alerts": 2, "max_age_s": 5400.0}
    code, out, err = main(capsys, "dashboard", "alerts", "-", "--json")
    assert code == cli.EXIT_USAGE and out == "" and "--json needs a FILE" in err[0]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--max-age", "abc"], ["argument --max-age: invalid duration 'abc'", "such as 90s, 30m"]),
        (["--max-age", "0"], ["argument --max-age: must be more than 0s", "got '0'"]),
        (["--max-age=-5m"], ["argument --max-age: invalid duration '-5m'"]),
        (["--max-age", "-5m"], ["argument --max-age: expected one argument"]),  # argparse takes -5m for an option
        (["--for", "soon"], ["argument --for: invalid duration 'soon'"]),
    ],
)
def test_bad_durations_are_usage_errors(tmp_path, capsys, args, fragments):
    path = tmp_path / "a.yml"
    code, out, err = main(capsys, "dashboard", "alerts", str(path), *args)
    assert code == cli.EXIT_USAGE and out == "" and not path.exists()
    assert len(err) == 1 and err[0].startswith("rayckpt: error: "), err
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])


def test_an_unwritable_file_is_exit_1(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    bad = str(tmp_path / "a-file" / "a.yml")
    code, out, err = main(capsys, "dashboard", "alerts", bad)
    assert code == cli.EXIT_FAILED and out == "" and len(err) == 1 and f"cannot write {bad}" in err[0], err
