"""What the deploy/ tests share: the paths of deploy/'s monitoring files and systemd units, the
tools that check them where installed (promtool, prometheus, systemd-analyze), readers of the
alert rules, scrape jobs, Grafana dashboard and PromQL, and the metric declarations
(coordinator/metrics.py, site_agent/metrics.py) they are held to."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from coordinator.metrics import CoordinatorMetrics
from site_agent.metrics import SiteMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS_YML = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "crossdc-dashboard.json"
GRAFANA_DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources"
GRAFANA_DASHBOARDS = DEPLOY / "grafana" / "provisioning" / "dashboards"
SYSTEMD = DEPLOY / "systemd"
CONFIGS = DEPLOY / "config"

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
INSTALL_HINT = "apt-get install -y --no-install-recommends prometheus"
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason=f"promtool is not installed ({INSTALL_HINT})"
)
WAIT_S = 45.0  # upper bound on waiting for Prometheus to scrape or evaluate; never a speed check

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason=f"prometheus is not installed ({INSTALL_HINT})"
)

DAY_S = 86400.0
# Series Prometheus makes itself for every target; everything else must be declared in metrics.py.
PROMETHEUS_SERIES = {"up"}
# prometheus-client's process and platform collectors, on both roles' registries: their names are
# the client's, not crossdc_.
STANDARD_PREFIXES = ("process_", "python_")
SEVERITIES = {"critical", "warning"}

# Values for Grafana's built-in variables when a query is run outside Grafana.
GRAFANA_BUILTINS = {"__rate_interval": "2m", "__interval": "30s", "__range": "1h"}


# --------------------------------------------------------------------------------------------
# Metric declarations


def _families() -> list[Any]:
    fams: list[Any] = []
    for registry in (CoordinatorMetrics().registry, SiteMetrics("x").registry):
        fams.extend(registry.collect())
    return fams


def declared_series_names() -> dict[str, str]:
    """Every series name the two metrics modules can expose, mapped to its family's type."""
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
    }
    names: dict[str, str] = {}
    for fam in _families():
        for suffix in suffixes[fam.type]:
            names[fam.name + suffix] = fam.type
    return names


def counter_series_names() -> set[str]:
    """The series that only go up: what rate(), irate() and increase() may be applied to."""
    out = set()
    for name, kind in declared_series_names().items():
        if (kind == "counter" and name.endswith("_total")) or (
            kind == "histogram" and name.endswith(("_bucket", "_count", "_sum"))
        ):
            out.add(name)
    return out


# --------------------------------------------------------------------------------------------
# Reading the deploy files (the venv has no YAML library; the files' layout is simple and fixed)


@dataclass
class AlertRule:
    name: str
    expr: str
    fields: dict[str, str]  # for, severity, summary, description: the raw text after the key


def alert_rules() -> list[AlertRule]:
    rules: list[AlertRule] = []
    lines = ALERTS_YML.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        i += 1
        if stripped.startswith("- alert:"):
            rules.append(AlertRule(stripped.split(":", 1)[1].strip(), "", {}))
            continue
        if not rules or ":" not in stripped or stripped.startswith("#"):
            continue
        key, value = (s.strip() for s in stripped.split(":", 1))
        if value in (">", ">-", "|", "|-"):  # a block scalar: the more-indented lines below
            indent = len(line) - len(line.lstrip())
            block = []
            while i < len(lines) and (
                not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
            ):
                block.append(lines[i].strip())
                i += 1
            value = " ".join(b for b in block if b)
        if key == "expr":
            rules[-1].expr = value
        else:
            rules[-1].fields[key] = value
    return rules


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel, rows included, and the panels inside collapsed rows."""
    out: list[dict[str, Any]] = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, Grafana variables substituted."""
    out = []
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            where = f"panel {panel['title']!r} target {target.get('refId')}"
            out.append((where, substitute_variables(target["expr"])))
    return out


def dashboard_variable_queries() -> list[tuple[str, str, str]]:
    """(variable, series selector, label) for every ``label_values(selector, label)`` variable."""
    out = []
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*", query)
        assert m, (
            f"variable {var['name']}: only label_values(selector, label) is supported: {query}"
        )
        out.append((var["name"], substitute_variables(m.group(1)), m.group(2)))
    return out


def substitute_variables(expr: str) -> str:
    """Replace $var / ${var} as Grafana would: built-ins by a duration, the dashboard's own
    variables by their "All" value. An unknown variable fails."""
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        assert name in variables, f"unknown variable ${name} in {expr!r}"
        var = variables[name]
        assert var.get("includeAll") and var.get("allValue"), f"${name} needs an allValue"
        return str(var["allValue"])

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


_STRIP = (
    (r'"(?:[^"\\]|\\.)*"', '""'),  # string literals
    (r"\{[^}]*\}", ""),  # label matchers
    (r"\[[^\]]*\]", ""),  # range and subquery durations
    (r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", ""),  # label lists
    (r"\boffset\s+\S+", ""),
)
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (identifiers that are not functions,
    keywords, labels or durations)."""
    s = expr
    for pattern, repl in _STRIP:
        s = re.sub(pattern, repl, s)
    found = re.findall(r"(?<![\w.$])([a-zA-Z_:][\w:]*)\b(?!\s*\()", s)
    return {name for name in found if name.lower() not in _KEYWORDS}


def counter_function_arguments(expr: str) -> set[str]:
    return set(re.findall(r"\b(?:rate|irate|increase)\(\s*([a-zA-Z_:][\w:]*)", expr))


def scrape_jobs() -> dict[str, list[tuple[str, dict[str, str]]]]:
    """job_name -> [(target, target labels)] from prometheus.yml."""
    jobs: dict[str, list[tuple[str, dict[str, str]]]] = {}
    job = None
    for line in PROMETHEUS_YML.read_text().splitlines():
        stripped = line.split("#", 1)[0].strip()
        if m := re.fullmatch(r"- job_name:\s*(\S+)", stripped):
            job = m.group(1)
            jobs[job] = []
        elif job and (m := re.fullmatch(r"- targets:\s*\[(.*)\]", stripped)):
            for target in re.findall(r'"([^"]+)"', m.group(1)):
                jobs[job].append((target, {}))
        elif (
            job
            and jobs[job]
            and (m := re.fullmatch(r"(\w+):\s*(\S+)", stripped))
            and m.group(1) not in ("labels", "metrics_path", "honor_labels", "scheme")
        ):
            jobs[job][-1][1][m.group(1)] = m.group(2)
    return jobs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, **params: str) -> Any:
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:  # 400/422 carry the error as JSON
        return json.loads(exc.read() or b"{}")


def wait_prometheus(predicate: Any, what: str, prom: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if prom.poll() is not None:
            raise AssertionError(
                f"prometheus exited ({prom.returncode}):\n{log.read_text()[-3000:]}"
            )
        try:
            value = predicate()
        except (OSError, ValueError):  # not listening yet, or a 503 (not JSON) while it starts
            value = None
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(
        f"timed out after {WAIT_S}s waiting for {what}:\n{log.read_text()[-3000:]}"
    )
