"""The metric names deploy/grafana/mmserve.json's panels read, for the tests that check a real server
exports each of them (tests/metrics/test_trace_e2e.py, tests/live/test_live.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "mmserve.json"

_PROMQL_STRIP = (
    re.compile(r'"(?:[^"\\]|\\.)*"'),                                      # string literals
    re.compile(r"\{[^}]*\}"),                                               # label matchers
    re.compile(r"\[[^\]]*\]"),                                              # range selectors
    re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"),  # label lists
)
_PROMQL_WORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "group_left",
                 "group_right", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions (followed by
    '('), keywords, label names or numbers."""
    for pattern in _PROMQL_STRIP:
        expr = pattern.sub(" ", expr)
    names = re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", expr)
    return {n for n in names if n.lower() not in _PROMQL_WORDS}


def dashboard_metric_names() -> dict[str, str]:
    """Metric name -> the title of a panel that reads it."""
    dashboard = json.loads(DASHBOARD.read_text())
    return {name: panel["title"] for panel in dashboard["panels"] for target in panel["targets"]
            for name in promql_metric_names(target["expr"])}
