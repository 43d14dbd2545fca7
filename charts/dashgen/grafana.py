"""Small builders for Grafana dashboard JSON (schema 39), used by the dashboard modules.

    slo_overview.py / instance.py / pools.py --(rows of panels)--> dashboard() --> JSON dict
        --> charts/slipstream/dashboards/*.json --> ConfigMaps the Grafana sidecar loads

Only what our dashboards use: time series, stat and table panels on one Prometheus data
source, chosen by a ``datasource`` variable, with rows laid out left to right on Grafana's
24-column grid. Every query is a ``Target``; tests read the queries back from the JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
PANEL_HEIGHT = 8


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[Target, ...]
    description: str
    kind: str = "timeseries"  # timeseries, stat, table
    unit: str = "short"
    width: int = 12
    overrides: tuple[dict, ...] = ()
    options: dict = field(default_factory=dict)


def timeseries(title: str, description: str, *targets: Target, unit: str = "short",
               width: int = 12, right_axis: tuple[str, ...] = ()) -> Panel:
    """A graph; series whose legend is in ``right_axis`` get their own axis (other units)."""
    overrides = tuple(
        {"matcher": {"id": "byName", "options": name},
         "properties": [{"id": "custom.axisPlacement", "value": "right"},
                        {"id": "unit", "value": "short"},
                        {"id": "custom.drawStyle", "value": "bars"}]}
        for name in right_axis)
    return Panel(title, targets, description, "timeseries", unit, width, overrides)


def stat(title: str, description: str, target: Target, *, unit: str = "short",
         width: int = 6) -> Panel:
    return Panel(title, (target,), description, "stat", unit, width,
                 options={"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"})


def table(title: str, description: str, target: Target, *, width: int = 24) -> Panel:
    return Panel(title, (Target(target.expr, target.legend, instant=True),), description,
                 "table", "short", width)


def query_variable(name: str, label: str, query: str, *, include_all: bool = True) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
            "refresh": 2, "includeAll": include_all, "multi": True, "allValue": ".*",
            "current": {"text": "All", "value": "$__all"} if include_all else {},
            "sort": 1}


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr,
                "legendFormat": t.legend or "__auto", "range": not t.instant,
                "instant": t.instant}
               for i, t in enumerate(panel.targets)]
    body: dict[str, Any] = {
        "id": panel_id, "type": panel.kind, "title": panel.title,
        "description": panel.description, "datasource": DATASOURCE,
        "gridPos": {"h": PANEL_HEIGHT, "w": panel.width, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": list(panel.overrides)},
        "options": dict(panel.options),
    }
    if panel.kind == "timeseries":
        body["options"].setdefault("legend", {"displayMode": "list", "placement": "bottom"})
        body["options"].setdefault("tooltip", {"mode": "multi", "sort": "desc"})
    return body


def dashboard(uid: str, title: str, description: str, rows: list[tuple[str, list[Panel]]],
              variables: list[dict], tags: tuple[str, ...] = ("slipstream",)) -> dict:
    """The dashboard JSON: a collapsed-free row header, then its panels, per row."""
    panels: list[dict[str, Any]] = []
    y, panel_id = 0, 1
    for row_title, row_panels in rows:
        panels.append({"id": panel_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "panels": []})
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row_panels:
            if x + panel.width > GRID_WIDTH:
                x, y = 0, y + PANEL_HEIGHT
            panels.append(_panel_json(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += PANEL_HEIGHT
    datasource_variable = {"name": "datasource", "label": "Data source", "type": "datasource",
                           "query": "prometheus", "current": {}, "hide": 0}
    return {
        "uid": uid, "title": title, "description": description, "tags": list(tags),
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
        "templating": {"list": [datasource_variable, *variables]},
        "annotations": {"list": []}, "links": [
            {"title": "Slipstream", "type": "dashboards", "tags": ["slipstream"],
             "asDropdown": True}],
        "panels": panels,
    }
