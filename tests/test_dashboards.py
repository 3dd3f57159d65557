"""The Grafana dashboard and the Prometheus alerts shipped in contrib/grafana:
each parses, and asks only for metrics and labels the app serves."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

import django_federation_delivery
from django_federation_delivery import metrics

from .test_webhooks_status import WEBHOOKS, configure

FOLDER = Path(django_federation_delivery.__file__).parent / "contrib" / "grafana"
DASHBOARD = FOLDER / "dashboard.json"
ALERTS = FOLDER / "alerts.yml"

#: What each type of metric is served as, by prometheus_client.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}
#: Labels that Prometheus gives every series it scrapes.
TARGET_LABELS = {"job", "instance"}

STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
MATCHERS = re.compile(r"\{([^{}]*)\}")
MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
RANGE = re.compile(r"\[[^\[\]]*\]")
VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
NUMBER = re.compile(r"(?<![\w:])(?:\d+(?:ms|[smhdwy]))+|(?<![\w:])\d[\d.]*(?:[eE][+-]?\d+)?")
NAME = re.compile(r"[A-Za-z_:][\w:]*")
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def parse(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names a PromQL expression uses.

    Not a PromQL parser: enough of one for these files, whose expressions
    are checked to balance first. What is left once strings, label
    matchers, groupings, ranges, Grafana's variables and numbers are taken
    out is functions (a name before a parenthesis), operators, and metric
    names.
    """
    labels: set[str] = set()
    text = STRING.sub('""', expr)
    for matchers in MATCHERS.findall(text):
        labels.update(MATCHER.findall(matchers))
    text = MATCHERS.sub(" ", text)
    for grouping in GROUPING.findall(text):
        labels.update(label.strip() for label in grouping.split(",") if label.strip())
    text = GROUPING.sub(" ", text)
    text = NUMBER.sub(" ", VARIABLE.sub(" ", RANGE.sub(" ", text)))
    names = {
        match.group()
        for match in NAME.finditer(text)
        if match.group() not in KEYWORDS and not text[match.end() :].lstrip().startswith("(")
    }
    return names, labels


def served() -> dict[str, set[str]]:
    """Every name the app serves, each with the labels its samples carry now."""
    found: dict[str, set[str]] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith(metrics.PREFIX):
            continue
        for suffix in SUFFIXES[family.type]:
            found.setdefault(family.name + suffix, set())
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def expressions() -> Iterator[tuple[str, str]]:
    """Each PromQL expression of both files, with where it is."""
    board = dashboard()
    for panel in board["panels"]:
        for target in panel["targets"]:
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in board["templating"]["list"]:
        # label_values(metric, label): a metric and a label, as an expression has them.
        query = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"])
        assert query, variable["query"]
        yield f"variable {variable['name']!r}", f"count by ({query[2]}) ({query[1]})"
    for rule in rules():
        yield f"alert {rule['alert']!r}", rule["expr"]


def balanced(expr: str) -> bool:
    depth: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for char in STRING.sub('""', expr):
        if char in "([{":
            depth.append(char)
        elif char in pairs and (not depth or depth.pop() != pairs[char]):
            return False
    return not depth


def test_the_parser_finds_names_and_labels_and_nothing_else() -> None:
    assert parse(
        'histogram_quantile(0.95, sum by (le) (rate(a_bucket{job=~"$job", x!="y"}'
        "[$__rate_interval]))) / ignoring(lane) b offset 5m > 1e3 or vector(0)"
        " and on() time() - max(c:d) > bool 2h30m"
    ) == ({"a_bucket", "b", "c:d"}, {"le", "job", "x", "lane"})


def test_the_dashboard_is_an_importable_dashboard_with_a_prometheus_input() -> None:
    board = dashboard()
    assert board["__inputs"] == [
        {
            "name": "DS_PROMETHEUS",
            "label": "Prometheus",
            "description": board["__inputs"][0]["description"],
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }
    ]
    assert board["id"] is None
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    source = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    used = {panel["type"] for panel in board["panels"]}
    assert used <= {item["id"] for item in board["__requires"] if item["type"] == "panel"}
    for panel in board["panels"]:
        assert panel["datasource"] == source, panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["description"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source, panel["title"]
    for variable in board["templating"]["list"]:
        assert variable["datasource"] == source


def test_the_dashboard_shows_what_an_operator_looks_for() -> None:
    names = set()
    for place, expr in expressions():
        if place.startswith("panel"):
            names |= parse(expr)[0]
    for name in (
        "federation_delivery_lane_lag_seconds",
        "federation_delivery_attempts_total",
        "federation_delivery_hosts_failing",
        "federation_delivery_open_breakers",
        "federation_delivery_deliverers_alive",
        "federation_delivery_webhook_destination_disabled",
    ):
        assert name in names


def test_the_rules_alert_on_what_stops_deliveries() -> None:
    found = {rule["alert"]: rule for rule in rules()}
    assert set(found) == {
        "FederationDeliveryNoDeliverer",
        "FederationDeliveryLagging",
        "FederationDeliveryWebhookDestinationDisabled",
        "FederationDeliveryHostFailing",
    }
    for rule in found.values():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]
    assert "federation_delivery_lane_lag_seconds" in found["FederationDeliveryLagging"]["expr"]
    assert found["FederationDeliveryLagging"]["for"] == "10m"


@pytest.mark.django_db
def test_every_metric_and_label_the_files_use_is_one_the_app_serves(settings: Any) -> None:
    # Once the deliverer has read the gauges, every labelled one has its series.
    configure(settings, WEBHOOKS)
    metrics.observe_queue()
    known = served()
    labels = TARGET_LABELS.union(*known.values())
    checked = 0
    for place, expr in expressions():
        assert balanced(expr), f"{place}: unbalanced {expr!r}"
        names, used = parse(expr)
        assert names, f"{place}: no metric in {expr!r}"
        for name in names:
            assert name in known, f"{place}: {name} is not a metric the app serves"
        assert used <= labels, f"{place}: no metric has the labels {used - labels}"
        checked += 1
    assert checked >= 15
