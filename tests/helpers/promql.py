"""The dashboard's queries, parsed with a real PromQL parser (``promql_parser``): the series each selects and the
labels it matches on or groups by; and whether a Prometheus export (a scrape's text) has every one."""

from __future__ import annotations

import re

import promql_parser

from rayckpt.observe.dashboard import PROMETHEUS_LABELS, PROMETHEUS_SERIES

#: Grafana's variables as a query runs with "All" selected (and the interval it picks).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$SessionName": ".*", "$run": ".*", "$node": ".*", "$tier": ".*"}


def substituted(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def parse(expr: str):
    return promql_parser.parse(substituted(expr))


def children(node) -> list:
    if isinstance(node, promql_parser.Call):
        return list(node.args)
    if isinstance(node, promql_parser.AggregateExpr):
        return [node.expr] + ([node.param] if node.param is not None else [])
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    if isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        return [node.expr]
    return []


def walk(node):
    yield node
    for child in children(node):
        yield from walk(child)


def names_and_labels(expr: str) -> tuple[set[str], set[str]]:
    """The series a query selects, and every label it matches on or groups by (from the parsed query)."""
    names, labels = set(), set()
    for node in walk(parse(expr)):
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
            labels.update(m.name for m in node.matchers.matchers)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
    return names, labels


_SAMPLE = re.compile(r"^(\w+)\{(.*)\} \S+$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def exported_series(text: str) -> dict[str, list[dict[str, str]]]:
    """A Prometheus text export: series name -> the label sets of its samples."""
    out: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out.setdefault(m.group(1), []).append(dict(_LABEL.findall(m.group(2))))
    return out


def missing_from_export(exprs: list[str], text: str, run: str) -> list[str]:
    """What ``exprs`` query that the export ``text`` lacks: a series with no sample of run ``run`` (where it has
    a ``run`` label) carrying every label the query matches on or groups by."""
    series = exported_series(text)
    missing = []
    for expr in exprs:
        names, labels = names_and_labels(expr)
        labels -= set(PROMETHEUS_LABELS)
        for name in sorted(names - set(PROMETHEUS_SERIES)):  # Prometheus's own, never on Ray's export
            samples = series.get(name, [])
            if any("run" in s for s in samples):
                samples = [s for s in samples if s.get("run") == run]
            if not any(labels <= set(s) for s in samples):
                have = sorted({k for s in samples for k in s})
                missing.append(f"{name} with labels {sorted(labels)} (exported: {len(samples)} samples, labels {have})")
    return missing
