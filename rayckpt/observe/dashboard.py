"""rayckpt's Grafana dashboard, generated from the metric definitions, and installing it where Ray's Grafana looks.

Panels are data (``PANELS``): each names its metrics by ``MetricDef.name`` and each
query is built from that definition (``exported()`` names: ``_bucket`` for quantiles,
``_total`` for counters), so a metric renamed or dropped from ``metric_defs`` fails
generation with a ``KeyError`` rather than leaving a panel that shows nothing. A query
grouping by a tag its metric does not have fails too (``ValueError``). A panel's unit
is its first metric's ``unit`` unless the panel names one.

Variables, as Ray's own dashboards have them: a hidden ``datasource`` (Prometheus),
``SessionName``, ``run`` and ``node``. Every query filters ``SessionName=~"$SessionName"``,
``run=~"$run"`` where its metric has a ``run`` tag and ``node=~"$node"`` where it has a
``node`` tag, plus the global filters: label matchers such as ``ray_io_cluster="prod"``,
read from ``RAY_GRAFANA_RAYCKPT_DASHBOARD_GLOBAL_FILTERS`` (comma-separated) as Ray reads
``RAY_GRAFANA_{name}_DASHBOARD_GLOBAL_FILTERS`` for its dashboards; they go into the
variables' queries too. ``RAY_GRAFANA_CLUSTER_FILTER`` is not a query filter: Ray's
dashboard UI adds it as ``var-Cluster`` to the address of the Ray dashboards it embeds,
which this one is not; to select one cluster of a shared Prometheus, set a global filter.

Counts (``increase``, ``count``, ``quantile``) treat a series' first sample as its increase from zero.
Ray exports a counter or histogram series from its first event on, so its first sample already holds
that event (a restore, once per worker start), and ``increase()`` alone never counts a series' first
sample: a one-time event would never show. ``increased`` adds the value of every series that is new
within the window, where its target was scraped before the window (``up offset``): so a series new
only to Prometheus (a Prometheus started beside a running cluster) does not show all its history at once.

``install`` writes the JSON where Ray's metrics head points Grafana's dashboard
provisioning (``dashboards_folder``: ``RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR``, else
``<RAY_METRICS_OUTPUT_ROOT or session_dir/metrics>/grafana/dashboards``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from grafanalib import core as g

from .metric_defs import COUNTER, GAUGE, HISTOGRAM, MetricDef, metric

UID = "rayckpt"
TITLE = "rayckpt checkpoints"
FILE_NAME = "rayckpt_grafana_dashboard.json"
GLOBAL_FILTERS_ENV = "RAY_GRAFANA_RAYCKPT_DASHBOARD_GLOBAL_FILTERS"
DASHBOARD_OUTPUT_DIR_ENV = "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"
METRICS_OUTPUT_ROOT_ENV = "RAY_METRICS_OUTPUT_ROOT"
DATASOURCE = "${datasource}"
RATE_WINDOW = "$__rate_interval"
#: Labels Ray's export puts on every metric (beside a metric's own tags) that queries use.
RAY_LABELS = ("SessionName",)
#: What Prometheus itself adds that queries use: each target's ``instance`` label and its ``up`` series.
PROMETHEUS_LABELS = ("instance",)
PROMETHEUS_SERIES = ("up",)
#: Any rayckpt series: what the variables list their values from.
ANY_METRIC = '__name__=~"ray_rayckpt_.+"'

_GRID_WIDTH = 24
_PANEL_HEIGHT = 8


@dataclass(frozen=True, kw_only=True)
class Query:
    """One target: ``how`` (``quantile``, ``increase``, ``count``, ``gauge``, ``age``) applied to
    metric ``name`` (its ``MetricDef.name``), aggregated ``by`` these tags; ``q`` for a quantile."""

    how: str
    name: str
    by: tuple[str, ...]
    legend: str = ""
    q: float = 0.0

    def expr(self, filters: Sequence[str]) -> str:
        """The PromQL: ``filters`` are the label matchers every selector gets beside the metric's own."""
        m = metric(self.name)
        bad = [t for t in self.by if t not in m.tags]
        if bad:
            raise ValueError(f"query of metric {m.name} groups by {bad}, not among its tags {list(m.tags)}")
        by = ", ".join(self.by)
        if self.how == "quantile":
            _need(m, HISTOGRAM)
            return f"histogram_quantile({self.q}, sum by (le, {by}) ({increased(_series(m, 'bucket', filters))}))"
        if self.how == "increase":
            _need(m, COUNTER)
            return f"sum by ({by}) ({increased(_series(m, '', filters))})"
        if self.how == "count":
            _need(m, HISTOGRAM)
            return f"sum by ({by}) ({increased(_series(m, 'count', filters))})"
        if self.how == "gauge":
            _need(m, GAUGE)
            return f"max by ({by}) ({_series(m, '', filters)})"
        if self.how == "age":
            _need(m, GAUGE)
            return f"time() - max by ({by}) ({_series(m, '', filters)})"
        raise ValueError(f"unknown query kind {self.how!r}")


def increased(selector: str, window: str = RATE_WINDOW) -> str:
    """How much each counter series of ``selector`` grew over ``window``, its first sample counted from zero.

    ``increase()`` for the series that existed before the window; for a series new within it, its value
    (it began at zero with its first event), where its target (``instance``) was scraped before the window.
    """
    new = f"(({selector} unless {selector} offset {window}) and on (instance) (up offset {window}))"
    return f"({new} or increase({selector}[{window}]))"


def _need(m: MetricDef, kind: str) -> None:
    if m.kind != kind:
        raise ValueError(f"metric {m.name} is a {m.kind}, the query needs a {kind}")


def _series(m: MetricDef, series: str, filters: Sequence[str]) -> str:
    """``m``'s exported series selected by the dashboard's variables and ``filters``."""
    matchers = ['SessionName=~"$SessionName"']
    matchers += [f'{tag}=~"${tag}"' for tag in ("run", "node") if tag in m.tags]
    return f"{m.exported(series)}{{{', '.join([*matchers, *filters])}}}"


@dataclass(frozen=True, kw_only=True)
class PanelDef:
    """One panel: its ``row``, ``title``, the question it answers (``description``), its ``queries``; ``stat``
    for a single figure rather than a time series, ``unit`` (default: the first query's metric's), ``width``
    in Grafana's 24 columns."""

    row: str
    title: str
    description: str
    queries: tuple[Query, ...]
    stat: bool = False
    unit: str = ""
    width: int = 8

    def unit_of(self) -> str:
        return self.unit or metric(self.queries[0].name).unit


RT = ("run", "tier")
AGE_SOURCE = "rayckpt_last_commit_timestamp_seconds"


def _quantile(name: str, by: tuple[str, ...], legend: str, q: float) -> Query:
    return Query(how="quantile", name=name, by=by, legend=legend, q=q)


def _quantiles(name: str, by: tuple[str, ...], legend: str) -> tuple[Query, ...]:
    return tuple(_quantile(name, by, f"p{round(q * 100)} {legend}", q=q) for q in (0.5, 0.95))


def _query(how: str, name: str, by: tuple[str, ...], legend: str) -> Query:
    return Query(how=how, name=name, by=by, legend=legend)


PANELS: tuple[PanelDef, ...] = (
    PanelDef(
        row="Saves",
        title="Save stall per rank (p50, p95)",
        description="How long each rank's training is blocked by a save (planning and the copy into shared memory).",
        queries=_quantiles("rayckpt_save_stall_seconds", ("run", "tier", "rank"), "{{run}} {{tier}} rank {{rank}}"),
    ),
    PanelDef(
        row="Saves",
        title="Save start to commit (p50, p95)",
        description="How long a save takes from its start until its manifest is committed.",
        queries=_quantiles("rayckpt_commit_seconds", RT, "{{run}} {{tier}}"),
    ),
    PanelDef(
        row="Saves",
        title="Write throughput",
        description="How fast the last shard write went, per run and tier.",
        queries=(_query("gauge", "rayckpt_write_throughput_bytes_per_second", RT, "{{run}} {{tier}}"),),
    ),
    PanelDef(
        row="Saves",
        title="Bytes written per tier",
        description="How many shard bytes saves wrote to each tier (per rate interval).",
        queries=(_query("increase", "rayckpt_bytes_written", RT, "{{run}} {{tier}}"),),
    ),
    PanelDef(
        row="Saves",
        title="Saves in flight",
        description="How many saves have begun and are neither committed nor rolled back.",
        queries=(_query("gauge", "rayckpt_saves_in_flight", RT, "{{run}} {{tier}}"),),
    ),
    PanelDef(
        row="Saves",
        title="Committed and failed saves",
        description="How many saves failed and were rolled back, beside how many committed.",
        queries=(
            _query("increase", "rayckpt_checkpoints_failed", RT, "failed {{run}} {{tier}}"),
            _query("increase", "rayckpt_checkpoints_committed", RT, "committed {{run}} {{tier}}"),
        ),
    ),
    PanelDef(
        row="Checkpoint age",
        title="Checkpoint age now",
        description="How much work a failure now would lose: seconds since each run's newest committed checkpoint.",
        queries=(_query("age", AGE_SOURCE, RT, "{{run}} {{tier}}"),),
        stat=True,
        unit="s",
    ),
    PanelDef(
        row="Checkpoint age",
        title="Checkpoint age",
        description="How much work a failure would have lost at each moment (time() minus the newest commit's "
        "timestamp, exact at query time; ray_rayckpt_checkpoint_age_seconds is the same figure as a gauge, "
        "for alert rules).",
        queries=(_query("age", AGE_SOURCE, RT, "{{run}} {{tier}}"),),
        unit="s",
        width=16,
    ),
    PanelDef(
        row="Memory tier",
        title="Memory held per node against its budget",
        description="How full each node's memory tier is: bytes held beside the node's budget.",
        queries=(
            _query("gauge", "rayckpt_memory_held_bytes", ("node",), "held {{node}}"),
            _query("gauge", "rayckpt_memory_budget_bytes", ("node",), "budget {{node}}"),
        ),
        width=12,
    ),
    PanelDef(
        row="Memory tier",
        title="Memory saves skipped",
        description="How many memory saves were not made, and why (busy: the one before was unwritten; "
        "no_room: sent to storage instead).",
        queries=(_query("increase", "rayckpt_memory_saves_skipped", ("run", "reason"), "{{run}} {{reason}}"),),
        width=12,
    ),
    PanelDef(
        row="Restores",
        title="Restores by tier",
        description="How many restores ran, by the tier they restored from.",
        queries=(_query("count", "rayckpt_restore_seconds", RT, "{{run}} {{tier}}"),),
        unit="short",
        width=12,
    ),
    PanelDef(
        row="Restores",
        title="Restore time by tier (p50, p95)",
        description="How long a worker's restore took, by the tier it restored from.",
        queries=_quantiles("rayckpt_restore_seconds", RT, "{{run}} {{tier}}"),
        width=12,
    ),
    PanelDef(
        row="Restores",
        title="Restored bytes by tier",
        description="Where restored bytes came from: this node's memory, a peer's memory or storage.",
        queries=(_query("increase", "rayckpt_restored_bytes", RT, "{{run}} {{tier}}"),),
        width=12,
    ),
    PanelDef(
        row="Restores",
        title="Restore fallbacks",
        description="How many restores passed over a damaged checkpoint for the one before it.",
        queries=(_query("increase", "rayckpt_restore_fallbacks", ("run",), "{{run}}"),),
        width=12,
    ),
    PanelDef(
        row="Loads",
        title="Load time (p95)",
        description="How long a worker spends loading a checkpoint.",
        queries=(_quantile("rayckpt_load_seconds", ("run",), "p95 {{run}}", q=0.95),),
        width=12,
    ),
    PanelDef(
        row="Loads",
        title="Bytes read and needed",
        description="How many bytes loads read against how many their targets needed (the gap is read waste; "
        "per rate interval).",
        queries=(
            _query("increase", "rayckpt_bytes_read", ("run",), "read {{run}}"),
            _query("increase", "rayckpt_bytes_needed", ("run",), "needed {{run}}"),
        ),
        width=12,
    ),
)


def global_filters_from_env() -> list[str]:
    """The label matchers of ``RAY_GRAFANA_RAYCKPT_DASHBOARD_GLOBAL_FILTERS`` (comma-separated; none: ``[]``)."""
    raw = os.environ.get(GLOBAL_FILTERS_ENV, "")
    return [f.strip() for f in raw.split(",") if f.strip()]


def _filters(global_filters: Sequence[str] | None) -> list[str]:
    return global_filters_from_env() if global_filters is None else [f.strip() for f in global_filters if f.strip()]


def panels(global_filters: Sequence[str] | None = None) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(row, title, description, PromQL expressions) of every panel, in order (None: filters from the env)."""
    filters = _filters(global_filters)
    return [(p.row, p.title, p.description, tuple(q.expr(filters) for q in p.queries)) for p in PANELS]


def _panel(p: PanelDef, filters: Sequence[str], x: int, y: int) -> g.Panel:
    targets = [
        g.Target(expr=q.expr(filters), legendFormat=q.legend, refId=chr(ord("A") + i), datasource=DATASOURCE)
        for i, q in enumerate(p.queries)
    ]
    common = dict(
        title=p.title,
        description=p.description,
        dataSource=DATASOURCE,
        targets=targets,
        gridPos=g.GridPos(h=_PANEL_HEIGHT, w=p.width, x=x, y=y),
    )
    if p.stat:
        return g.Stat(**common, format=p.unit_of(), reduceCalc="lastNotNull", graphMode="none", colorMode="value")
    return g.TimeSeries(**common, unit=p.unit_of(), legendDisplayMode="list", tooltipMode="multi")


def _layout(filters: Sequence[str]) -> list[g.Panel]:
    """Row panels each followed by its panels, left to right and wrapping at Grafana's 24 columns."""
    out: list[g.Panel] = []
    y = 0
    rows = list(dict.fromkeys(p.row for p in PANELS))
    for row in rows:
        out.append(g.RowPanel(title=row, dataSource=DATASOURCE, gridPos=g.GridPos(h=1, w=_GRID_WIDTH, x=0, y=y)))
        y += 1
        x = 0
        for p in (p for p in PANELS if p.row == row):
            if x + p.width > _GRID_WIDTH:
                x, y = 0, y + _PANEL_HEIGHT
            out.append(_panel(p, filters, x, y))
            x += p.width
        y += _PANEL_HEIGHT
    return out


def _variable(name: str, matchers: Sequence[str], *, multi: bool, description: str, series: str = "") -> dict:
    """A query variable listing the values of label ``name`` of ``series`` (none: any rayckpt series)."""
    selector = [*([] if series else [ANY_METRIC]), *matchers]
    query = f"label_values({series}{{{', '.join(selector)}}}, {name})"
    data = g.Template(
        name=name,
        query=query,
        dataSource=DATASOURCE,
        includeAll=True,
        multi=multi,
        allValue=".*",
        refresh=g.REFRESH_ON_DASHBOARD_LOAD,
        sort=g.SORT_ALPHA_ASC,
    ).to_json_data()
    data.update(description=description, definition=query, current={"text": ["All"], "value": ["$__all"]})
    return data


def _variables(filters: Sequence[str]) -> list[dict]:
    datasource = g.Template(name="datasource", query="prometheus", type="datasource", hide=g.HIDE_VARIABLE)
    data = datasource.to_json_data()
    data.update(description="The Prometheus data source the queries read.", current={"selected": False})
    in_session = ['SessionName=~"$SessionName"', *filters]
    node_series = metric("rayckpt_memory_held_bytes").exported()
    return [
        data,
        _variable("SessionName", filters, multi=False, description="The Ray session (one start of the cluster)."),
        _variable("run", in_session, multi=True, description="The runs (a Checkpointer's run name)."),
        _variable("node", in_session, multi=True, description="The memory tier's nodes.", series=node_series),
    ]


def dashboard(global_filters: Sequence[str] | None = None) -> dict:
    """The dashboard as Grafana's JSON model (a dict); ``global_filters``: None reads them from the env."""
    filters = _filters(global_filters)
    board = g.Dashboard(
        title=TITLE,
        uid=UID,
        tags=["rayckpt"],
        description="rayckpt's saves, checkpoint age, memory tier, restores and loads, from Ray's metrics.",
        refresh="10s",
        time=g.Time("now-30m", "now"),
        timezone="browser",
        schemaVersion=27,
        graphTooltip=g.GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
        panels=_layout(filters),
        templating=g.Templating(list=_variables(filters)),
    ).auto_panel_ids()
    return json.loads(json.dumps(board.to_json_data(), default=lambda obj: obj.to_json_data()))


def dashboard_json(global_filters: Sequence[str] | None = None) -> str:
    """``dashboard()`` as JSON text (sorted keys, indented: the same dashboard gives the same bytes)."""
    return json.dumps(dashboard(global_filters), indent=2, sort_keys=True) + "\n"


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder and ``os.replace``: a reader
    (Grafana's provisioning scan) sees the old file or the new one, never half of one."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def install(folder: str, global_filters: Sequence[str] | None = None) -> str:
    """Write the dashboard as ``<folder>/rayckpt_grafana_dashboard.json`` (the folder made if missing);
    return its path. Installing again replaces it. An ``OSError`` when the folder cannot be written."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, FILE_NAME)
    write_atomic(path, dashboard_json(global_filters))
    return path


def dashboards_folder(session_dir: str) -> str:
    """Where Ray's metrics head points Grafana for dashboards (as Ray's ``metrics_head`` computes it)."""
    root = os.environ.get(METRICS_OUTPUT_ROOT_ENV, os.path.join(session_dir, "metrics"))
    return os.environ.get(DASHBOARD_OUTPUT_DIR_ENV, os.path.join(root, "grafana", "dashboards"))
