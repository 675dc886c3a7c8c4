"""The Grafana dashboard's expressions (contrib/grafana/kvoffload.json) run by Prometheus's own
tools: promtool parses every expression (as recording rules); live, a real Prometheus scrapes an
endpoint exporting every core metric (prometheus-client, labels filled in) and every panel
expression, with Grafana's variables substituted, returns data. The static checks of the names and
labels are tests/unit/test_grafana.py, whose helpers this file shares.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest
from prom import require_prometheus, start_prometheus
from unit.test_grafana import _all_exprs

from kvoffload.metrics import CORE_METRICS

LABEL_VALUES_RE = re.compile(r"^\s*label_values\(\s*(.+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$")


# Grafana's variables, as the live check substitutes them: ".+" (not the dashboard's all-value ".*")
# so a matcher on a label the metric lacks finds nothing and fails the check.
VARIABLES = {
    "$__rate_interval": "4s",
    "$__interval": "1s",
    "$__range": "1m",
    "${instance}": ".+",
    "$instance": ".+",
    "${tier}": ".+",
    "$tier": ".+",
}


def _substitute(expr: str) -> str:
    for var in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(var, VARIABLES[var])
    assert "$" not in expr, f"unknown Grafana variable left in {expr!r}"
    return expr


def _as_promql(expr: str) -> str:
    """A variable's ``label_values(selector, label)`` as the query Grafana's list would come from."""
    m = LABEL_VALUES_RE.match(expr)
    return f"count by ({m.group(2)}) ({m.group(1)})" if m else expr


# -- promtool -------------------------------------------------------------------------------------


@pytest.mark.prometheus
def test_promtool_parses_every_expression(tmp_path):
    binary = require_prometheus()
    promtool = str(Path(binary).with_name("promtool"))
    rules = [
        {"record": f"kvoffload_dashboard:expr{i}", "expr": _as_promql(_substitute(expr))}
        for i, (_, expr) in enumerate(_all_exprs())
    ]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    res = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules)} rules found" in res.stdout, res.stdout


# -- live -----------------------------------------------------------------------------------------


LABEL_VALUES = {
    "tier": ("host", "fs"),
    "direction": ("store", "load"),
    "reason": ("io_error", "timeout"),
    "event": ("retries",),
    "stream": ("engine", "movements"),
    "state": ("closed", "open", "half_open"),
    "errno": ("EACCES", "EIO"),
}


@pytest.fixture(scope="module")
def scraped():
    """A Prometheus that has scraped every core metric (with an ``instance`` label, as standalone) at
    least four times."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

    reg = CollectorRegistry()
    series = []
    for d in CORE_METRICS:
        cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[d.kind]
        kwargs = (
            {"buckets": d.buckets} if d.kind == "histogram" and getattr(d, "buckets", None) else {}
        )
        m = cls(
            d.name, d.documentation or d.name, ("instance", *d.labelnames), registry=reg, **kwargs
        )
        for values in itertools.product(*(LABEL_VALUES.get(lbl, ("x",)) for lbl in d.labelnames)):
            child = m.labels("test-0", *values)
            series.append((d.kind, child))
    for kind, child in series:
        if kind == "counter":
            child.inc(10)
        elif kind == "gauge":
            child.set(1)
        else:
            for v in (1e-5, 1e-3, 0.1):
                child.observe(v)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        with start_prometheus(
            [f"127.0.0.1:{server.server_address[1]}"], scrape_interval_s=0.5
        ) as prom:
            prom.wait_until_up()
            prom.wait_for("count_over_time(up[1m])", lambda r: r and float(r[0]["value"][1]) >= 4)
            yield prom
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.prometheus
@pytest.mark.parametrize(
    "where,expr", _all_exprs(), ids=[re.sub(r"\W+", "-", w).strip("-") for w, _ in _all_exprs()]
)
def test_expression_returns_data_from_a_real_prometheus(scraped, where, expr):
    promql = _as_promql(_substitute(expr))
    rows = scraped.query(promql)  # raises PromQueryError on a parse or execution error
    assert rows, f"{where}: {promql!r} returned nothing"
