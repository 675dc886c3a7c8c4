"""The Grafana dashboard (contrib/grafana/kvoffload.json) against the metric definitions, read
statically: every ``kvoffload_*`` name in a panel or variable query is a metric of
``kvoffload.metrics.CORE_METRICS`` and of docs/observability.md, spelled as the exposition has it
(counters ``_total``; histograms ``_bucket``/``_sum``/``_count``; gauges bare), with label names the
metric has; counters only under ``rate``/``increase``, gauges never.

promtool and a real Prometheus run every expression: tests/integration/test_grafana.py.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

from kvoffload.metrics import CORE_METRICS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "contrib" / "grafana" / "kvoffload.json"
DOC = ROOT / "docs" / "observability.md"

SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
# Labels every series may carry besides its own: the scrape target's (or, standalone, the manager's)
# instance and job; under vLLM also model_name and engine.
COMMON_LABELS = {"instance", "job", "model_name", "engine"}
# Core metrics deliberately left off the dashboard: kvoffload_warm_restart_chunks is counted once,
# at start, so its series is born at its value and increase() (the only way a counter is shown
# here) never sees it; operators read it from the endpoint and the start's log line.
NOT_ON_DASHBOARD: set[str] = {"kvoffload_warm_restart_chunks"}

NAME_RE = re.compile(r"\bkvoffload_[A-Za-z0-9_]*")
SELECTOR_RE = re.compile(r"\b(kvoffload_[A-Za-z0-9_]*)\s*\{([^}]*)\}")
MATCHER_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
BY_RE = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
RATE_RE = re.compile(r"\b(rate|irate|increase|delta|idelta|deriv)\s*\(\s*(kvoffload_[A-Za-z0-9_]*)")


def _dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row holds its panels
    return out


def _panel_exprs(dash: dict) -> list[tuple[str, str]]:
    """``(where, expr)`` for every panel target."""
    return [
        (f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"])
        for p in _panels(dash)
        for t in p.get("targets", [])
    ]


def _variable_queries(dash: dict) -> list[tuple[str, str]]:
    out = []
    for v in dash["templating"]["list"]:
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']}", q))
    return out


def _all_exprs() -> list[tuple[str, str]]:
    dash = _dashboard()
    return _panel_exprs(dash) + _variable_queries(dash)


def _exposition_names() -> dict[str, tuple[object, str]]:
    """exposition name -> (definition, suffix)"""
    out = {}
    for d in CORE_METRICS:
        for suffix in SUFFIXES[d.kind]:
            out[d.name + suffix] = (d, suffix)
    return out


def _documented_names() -> set[str]:
    """Exposition names of docs/observability.md's table (histograms with their three series)."""
    out = set()
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\|\s*`(kvoffload_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|", line)
        if m:
            name, kind = m.groups()
            if kind == "histogram":
                out.update(name + s for s in SUFFIXES["histogram"])
            else:
                out.add(name)
    return out


# -- structure ------------------------------------------------------------------------------------


def test_dashboard_is_an_importable_grafana_10_dashboard():
    dash = _dashboard()
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    assert dash["__inputs"][0]["pluginId"] == "prometheus"
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    assert dash.get("id") is None  # an export for sharing carries no database id
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"instance", "tier"} <= set(variables)
    for v in variables.values():
        assert v["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]
    # no two panels overlap
    cells = {}
    for p in panels:
        g = p["gridPos"]
        for x, y in itertools.product(
            range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        ):
            assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
            cells[(x, y)] = p["title"]


# -- names and labels -----------------------------------------------------------------------------


def test_every_metric_on_the_dashboard_is_defined_and_documented():
    known = _exposition_names()
    documented = _documented_names()
    errors, used = [], set()
    for where, expr in _all_exprs():
        names = NAME_RE.findall(expr)
        assert names, f"{where}: no kvoffload metric in {expr!r}"
        for name in names:
            if name not in known:
                base = re.sub(r"_(total|bucket|sum|count)$", "", name)
                defined = [d for d in CORE_METRICS if d.name in (base, name)]
                if defined:
                    d = defined[0]
                    hint = f" ({d.kind}: use {', '.join(d.name + s for s in SUFFIXES[d.kind])})"
                else:
                    hint = " (no such metric in kvoffload.metrics.CORE_METRICS)"
                errors.append(f"{where}: {name}{hint}")
                continue
            used.add(known[name][0].name)
            if name not in documented:
                errors.append(f"{where}: {name} is not in docs/observability.md's table")
    assert not errors, "\n".join(errors)
    missing = {d.name for d in CORE_METRICS} - used - NOT_ON_DASHBOARD
    assert not missing, (
        f"core metrics not on the dashboard: {sorted(missing)}; add a panel to "
        f"{DASHBOARD.relative_to(ROOT)} or list them in NOT_ON_DASHBOARD"
    )


def test_labels_used_on_the_dashboard_exist():
    known = _exposition_names()
    errors = []
    for where, expr in _all_exprs():
        metrics = [known[n] for n in NAME_RE.findall(expr) if n in known]
        for name, matchers in SELECTOR_RE.findall(expr):
            if name not in known:
                continue
            d, suffix = known[name]
            allowed = COMMON_LABELS | set(d.labelnames) | ({"le"} if suffix == "_bucket" else set())
            for label in MATCHER_RE.findall(matchers):
                if label not in allowed:
                    errors.append(f"{where}: {name} has no label {label!r} (it has {d.labelnames})")
        allowed = COMMON_LABELS | {lbl for d, _ in metrics for lbl in d.labelnames}
        if any(s == "_bucket" for _, s in metrics):
            allowed.add("le")
        for group in BY_RE.findall(expr):
            for label in filter(None, (s.strip() for s in group.split(","))):
                if label not in allowed:
                    errors.append(f"{where}: grouping by {label!r}, which none of its metrics has")
    assert not errors, "\n".join(errors)


def test_counters_are_rated_and_gauges_are_not():
    known = _exposition_names()
    errors = []
    for where, expr in _panel_exprs(_dashboard()):
        rated = {name for _, name in RATE_RE.findall(expr)}
        for name in rated:
            if name in known and known[name][0].kind == "gauge":
                errors.append(f"{where}: rate/increase over the gauge {name}")
        for name in NAME_RE.findall(expr):
            if (
                name in known
                and known[name][1] in ("_total", "_bucket", "_sum", "_count")
                and name not in rated
            ):
                errors.append(
                    f"{where}: {name} (a monotonic series) is shown without rate/increase"
                )
    assert not errors, "\n".join(errors)
