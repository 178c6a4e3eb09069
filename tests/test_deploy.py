"""Tests for deploy/: the Prometheus config and alert rules, the Grafana dashboard and its
provisioning, and the systemd units.

Names are checked against the metric declarations (coordinator/metrics.py, site_agent/metrics.py);
queries and rules are checked by promtool and by a real Prometheus scraping a live /metrics.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from comm.ops.observe import ObserveServer
from coordinator.metrics import CoordinatorMetrics
from crossdc.cli import EXIT_BAD_CONFIG
from site_agent.exits import EXIT_AUTH_REFUSED, EXIT_FATAL
from site_agent.metrics import SiteMetrics

ROOT = Path(__file__).resolve().parent.parent
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
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason=f"prometheus is not installed ({INSTALL_HINT})"
)

DAY_S = 86400.0
WAIT_S = 45.0  # upper bound on waiting for Prometheus to scrape or evaluate; never a speed check

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


@pytest.mark.timeout(30)
def test_declared_names_follow_the_design() -> None:
    """The lists the other tests check against are not empty and carry the crossdc_ prefix."""
    names = declared_series_names()
    assert "crossdc_rounds_total" in names
    assert "crossdc_round_duration_seconds_bucket" in names
    assert "crossdc_site_compute_utilization" in names
    assert "crossdc_build_info" in names
    assert "process_cpu_seconds_total" in names and "python_info" in names
    assert all(n.startswith(("crossdc_", *STANDARD_PREFIXES)) for n in names)


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


@pytest.mark.timeout(30)
def test_file_readers_see_the_files() -> None:
    """Guard for the readers above: they find what a quick count of the raw text finds."""
    text = ALERTS_YML.read_text()
    rules = alert_rules()
    assert len(rules) == len(re.findall(r"^\s*- alert:", text, flags=re.M)) > 0
    assert all(r.expr for r in rules), [r.name for r in rules if not r.expr]
    jobs = scrape_jobs()
    assert set(jobs) == {"crossdc-coordinator", "crossdc-site"}
    assert dashboard_queries()
    assert promql_metric_names(
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{x="y"}[5m]))) / on () b offset 1h'
    ) == {"a_bucket", "b"}


# --------------------------------------------------------------------------------------------
# Prometheus config and alert rules, without a running Prometheus


@needs_promtool
@pytest.mark.timeout(60)
def test_promtool_check_config() -> None:
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "check", "config", str(PROMETHEUS_YML)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rule files found" in proc.stdout + proc.stderr


@needs_promtool
@pytest.mark.timeout(60)
def test_promtool_check_rules() -> None:
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS_YML)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(alert_rules())} rules found" in proc.stdout + proc.stderr


@pytest.mark.timeout(30)
def test_every_alert_has_for_severity_and_annotations() -> None:
    names = [r.name for r in alert_rules()]
    assert len(names) == len(set(names)), "duplicate alert names"
    for rule in alert_rules():
        assert re.fullmatch(r"\d+[smh]", rule.fields.get("for", "")), f"{rule.name}: for:"
        assert rule.fields.get("severity") in SEVERITIES, f"{rule.name}: severity"
        assert rule.fields.get("summary"), f"{rule.name}: summary"
        assert rule.fields.get("description"), f"{rule.name}: description"


@pytest.mark.timeout(30)
def test_alerts_use_only_declared_metrics() -> None:
    declared = declared_series_names()
    for rule in alert_rules():
        unknown = promql_metric_names(rule.expr) - declared.keys() - PROMETHEUS_SERIES
        assert not unknown, f"{rule.name}: undeclared metrics {unknown} in {rule.expr!r}"
        not_counters = counter_function_arguments(rule.expr) - counter_series_names()
        assert not not_counters, f"{rule.name}: rate/increase of a non-counter {not_counters}"
    # Anything that looks like a metric anywhere in the file (comments, annotations) is real too.
    mentioned = set(re.findall(r"\bcrossdc_[a-z0-9_]+\b", ALERTS_YML.read_text()))
    assert not mentioned - declared.keys(), mentioned - declared.keys()


# Synthetic series for `promtool test rules` (promql_expr_test: an expression's result at one
# time, annotations aside): alert name -> (input series, values), the samples its expr must give
# at EVAL_S seconds after time 0.
EVAL_S = 600
_SITE = 'job="crossdc-site",instance="s-{0}:9711",site="{0}"'
_COORD = 'job="crossdc-coordinator",instance="c:9710"'
_NOT_AFTER = {"eu": EVAL_S + 3 * DAY_S, "us-old": EVAL_S + 2 * DAY_S, "us": EVAL_S + 80 * DAY_S}
EXPR_CASES: dict[str, tuple[list[tuple[str, str]], list[tuple[str, float]]]] = {
    # Low goodput counts only once measured: "us" has no sample yet, "ap" is fast.
    "CrossdcSiteGoodputLow": (
        [
            (f"crossdc_site_link_goodput_bytes_per_second{{{_SITE.format('eu')}}}", "5e5x20"),
            (f"crossdc_site_link_measured{{{_SITE.format('eu')}}}", "1x20"),
            (f"crossdc_site_link_goodput_bytes_per_second{{{_SITE.format('us')}}}", "0x20"),
            (f"crossdc_site_link_measured{{{_SITE.format('us')}}}", "0x20"),
            (f"crossdc_site_link_goodput_bytes_per_second{{{_SITE.format('ap')}}}", "5e6x20"),
            (f"crossdc_site_link_measured{{{_SITE.format('ap')}}}", "1x20"),
        ],
        [(f"crossdc_site_link_goodput_bytes_per_second{{{_SITE.format('eu')}}}", 5e5)],
    ),
    # The newest certificate of each site counts: "us" was renewed, "ap" has expired.
    "CrossdcCertificateExpiring": (
        [
            (
                f'crossdc_certificate_expiry_timestamp_seconds{{{_COORD},site="{site}",'
                f'serial="{serial}"}}',
                f"{value:.0f}x20",
            )
            for site, serial, value in [
                ("eu", "1", _NOT_AFTER["eu"]),
                ("us", "2", _NOT_AFTER["us-old"]),
                ("us", "3", _NOT_AFTER["us"]),
                ("ap", "4", 0.0),
            ]
        ],
        [
            (f'{{{_COORD},site="eu"}}', 3 * DAY_S),
            (f'{{{_COORD},site="ap"}}', -float(EVAL_S)),
        ],
    ),
    "CrossdcCACertificateExpiring": (
        [
            (
                f"crossdc_ca_certificate_expiry_timestamp_seconds{{{_COORD}}}",
                f"{EVAL_S + 30 * DAY_S:.0f}x20",
            )
        ],
        [(f"{{{_COORD}}}", 30 * DAY_S)],
    ),
    "CrossdcSiteCertificateExpiring": (
        [
            (
                f"crossdc_site_certificate_expiry_timestamp_seconds{{{_SITE.format('eu')}}}",
                f"{_NOT_AFTER['eu']:.0f}x20",
            ),
            (
                f"crossdc_site_certificate_expiry_timestamp_seconds{{{_SITE.format('us')}}}",
                f"{_NOT_AFTER['us']:.0f}x20",
            ),
        ],
        [(f"{{{_SITE.format('eu')}}}", 3 * DAY_S)],
    ),
    # Two versions among three processes.
    "CrossdcVersionMismatch": (
        [
            (f'crossdc_build_info{{{_COORD},version="0.2.0"}}', "1x20"),
            (f'crossdc_build_info{{{_SITE.format("eu")},version="0.2.0"}}', "1x20"),
            (f'crossdc_build_info{{{_SITE.format("us")},version="0.1.0"}}', "1x20"),
        ],
        [("{}", 2.0)],
    ),
}


@needs_promtool
@pytest.mark.timeout(60)
def test_alert_expressions_select_what_they_should(tmp_path: Path) -> None:
    """`promtool test rules` evaluates the expressions of the alerts whose logic is more than a
    threshold (measured-only goodput, the newest certificate per site, distinct versions) on
    synthetic series, and the result must be exactly the expected samples."""
    assert PROMTOOL is not None
    rules = {r.name: r for r in alert_rules()}
    tests = [
        {
            "interval": "1m",
            "input_series": [{"series": series, "values": values} for series, values in inputs],
            "promql_expr_test": [
                {
                    "expr": rules[name].expr,
                    "eval_time": f"{EVAL_S}s",
                    "exp_samples": [{"labels": lab, "value": value} for lab, value in samples],
                }
            ],
        }
        for name, (inputs, samples) in EXPR_CASES.items()
    ]
    path = tmp_path / "expr-tests.yml"
    path.write_text(json.dumps({"evaluation_interval": "1m", "tests": tests}, indent=1))
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=45
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


@pytest.mark.timeout(30)
def test_jobs_named_in_queries_are_scraped() -> None:
    jobs = set(scrape_jobs())
    exprs = [r.expr for r in alert_rules()] + [q for _, q in dashboard_queries()]
    for expr in exprs:
        for op, pattern in re.findall(r'\bjob\s*(=~|=)\s*"([^"]*)"', expr):
            matched = {
                j for j in jobs if (re.fullmatch(pattern, j) if op == "=~" else j == pattern)
            }
            assert matched, f"job {op}{pattern!r} matches no scrape job in {expr!r}"


@pytest.mark.timeout(30)
def test_scrape_targets_match_the_example_configs() -> None:
    """The ports Prometheus scrapes are the metrics_port of the example configs, and every
    example site has a target labelled with its site id."""
    jobs = scrape_jobs()
    coord = tomllib.loads((CONFIGS / "coordinator.toml").read_text())["coordinator"]
    assert all(t.endswith(f":{coord['metrics_port']}") for t, _ in jobs["crossdc-coordinator"])
    site_targets = {labels.get("site"): target for target, labels in jobs["crossdc-site"]}
    for path in sorted(CONFIGS.glob("site-*.toml")):
        site = tomllib.loads(path.read_text())["site"]
        assert site["site_id"] in site_targets, f"no scrape target for {path.name}"
        assert site_targets[site["site_id"]].endswith(f":{site['metrics_port']}")
    # Site metrics carry their own `site` label; the target label must not rename it.
    site_job = PROMETHEUS_YML.read_text().split("job_name: crossdc-site", 1)[1]
    assert re.search(r"^\s*honor_labels:\s*true\s*$", site_job, flags=re.M)


# --------------------------------------------------------------------------------------------
# Grafana dashboard and provisioning


@pytest.mark.timeout(30)
def test_dashboard_is_valid_json_with_a_datasource_variable() -> None:
    dash = dashboard()
    assert 36 <= dash["schemaVersion"] <= 39
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


@pytest.mark.timeout(30)
def test_every_panel_has_a_datasource_and_a_target() -> None:
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    graphs = [p for p in panels if p["type"] != "row"]  # rows only group panels
    assert len(graphs) >= 12
    for panel in graphs:
        title = panel.get("title")
        assert title, f"panel {panel['id']} has no title"
        assert panel.get("datasource", {}).get("uid") == "${datasource}", title
        assert panel.get("targets"), f"{title}: no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"{title}: duplicate refId"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{title}: empty query"
            assert target.get("datasource", {}).get("uid") == "${datasource}", title


@pytest.mark.timeout(30)
def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                other = cells.setdefault((x, y), panel["title"])
                assert other == panel["title"], f"{panel['title']!r} overlaps {other!r}"


@pytest.mark.timeout(30)
def test_dashboard_uses_only_declared_metrics() -> None:
    declared = declared_series_names()
    queries = dashboard_queries() + [
        (f"variable {name}", selector) for name, selector, _ in dashboard_variable_queries()
    ]
    for where, expr in queries:
        unknown = promql_metric_names(expr) - declared.keys() - PROMETHEUS_SERIES
        assert not unknown, f"{where}: undeclared metrics {unknown} in {expr!r}"
        not_counters = counter_function_arguments(expr) - counter_series_names()
        assert not not_counters, f"{where}: rate/increase of a non-counter {not_counters}"


@pytest.mark.timeout(30)
def test_dashboard_covers_the_design() -> None:
    """docs/architecture.md, "Observability": rounds, durations, membership, loss, WAN bytes,
    compression, rejections, site efficiency, link, error feedback and privacy are all on the
    dashboard."""
    used = set().union(*(promql_metric_names(q) for _, q in dashboard_queries()))
    for name in (
        "crossdc_rounds_total",
        "crossdc_round_duration_seconds_bucket",
        "crossdc_members",
        "crossdc_val_loss",
        "crossdc_train_loss",
        "crossdc_wire_bytes_total",
        "crossdc_payload_raw_bytes_total",
        "crossdc_payload_bytes_total",
        "crossdc_rejected_total",
        "crossdc_site_compute_utilization",
        "crossdc_site_sync_stall_seconds_total",
        "crossdc_site_link_rtt_seconds",
        "crossdc_site_link_goodput_bytes_per_second",
        "crossdc_site_link_measured",
        "crossdc_site_certificate_expiry_timestamp_seconds",
        "crossdc_certificate_expiry_timestamp_seconds",
        "crossdc_site_error_feedback_norm",
        "crossdc_site_dp_epsilon",
    ):
        assert name in used, f"no panel shows {name}"


@pytest.mark.timeout(30)
def test_grafana_provisioning_points_at_the_dashboard_datasource() -> None:
    (datasources,) = GRAFANA_DATASOURCES.glob("*.yml")
    (providers,) = GRAFANA_DASHBOARDS.glob("*.yml")
    ds_text = datasources.read_text()
    assert re.search(r"^\s*type:\s*prometheus\s*$", ds_text, flags=re.M)
    uid = re.search(r"^\s*uid:\s*(\S+)\s*$", ds_text, flags=re.M)
    assert uid, "the provisioned data source needs a fixed uid"
    default = {v["name"]: v for v in dashboard()["templating"]["list"]}["datasource"]["current"]
    assert default.get("value") == uid.group(1)
    prov_text = providers.read_text()
    assert re.search(r"^\s*type:\s*file\s*$", prov_text, flags=re.M)
    assert re.search(r"^\s*path:\s*/\S+\s*$", prov_text, flags=re.M)


# --------------------------------------------------------------------------------------------
# systemd units


def _unit(name: str) -> str:
    return (SYSTEMD / name).read_text()


def _unit_values(text: str, key: str) -> list[str]:
    return re.findall(rf"^{key}=(.*)$", text, flags=re.M)


@pytest.mark.timeout(30)
def test_units_run_the_cli_with_restart_and_hardening() -> None:
    coord, agent = _unit("crossdc-coordinator.service"), _unit("crossdc-agent@.service")
    assert re.search(r"^ExecStart=\S+/crossdc coordinator --config \S+\.toml$", coord, re.M)
    assert re.search(
        r"^ExecStart=\S+/crossdc agent --config /etc/crossdc/site-%i\.toml$", agent, re.M
    )
    assert _unit_values(coord, "RestartPreventExitStatus") == [str(EXIT_BAD_CONFIG)]
    assert _unit_values(agent, "RestartPreventExitStatus") == [
        f"{EXIT_BAD_CONFIG} {EXIT_FATAL} {EXIT_AUTH_REFUSED}"
    ]
    assert _unit_values(agent, "KillMode") == ["mixed"]  # the leader drains, then the rest
    for text in (coord, agent):
        assert _unit_values(text, "Restart") == ["on-failure"]
        assert _unit_values(text, "NoNewPrivileges") == ["yes"]
        assert _unit_values(text, "ProtectSystem") == ["strict"]
        assert _unit_values(text, "User") == ["crossdc"]


@pytest.mark.timeout(30)
def test_the_example_coordinator_builds_the_example_sites_theta0() -> None:
    """The coordinator's [initial_model] names the seed and model every example site builds, so
    the sites join in sync and nothing is uploaded."""
    from coordinator.config import load_coordinator_config
    from site_agent.config import load_site_config

    initial = load_coordinator_config(CONFIGS / "coordinator.toml").initial_model
    assert initial is not None
    for path in sorted(CONFIGS.glob("site-*.toml")):
        site = load_site_config(path)
        assert site.seed == initial.seed, path.name
        assert dataclasses.asdict(site.model) == {
            **dataclasses.asdict(type(site.model)()),
            **initial.model,
        }, path.name


@pytest.mark.timeout(30)
def test_units_can_write_the_state_dirs_of_the_example_configs() -> None:
    coord = tomllib.loads((CONFIGS / "coordinator.toml").read_text())["coordinator"]
    assert _unit_values(_unit("crossdc-coordinator.service"), "ReadWritePaths") == [
        coord["state_dir"]
    ]
    agent = _unit("crossdc-agent@.service")
    for path in sorted(CONFIGS.glob("site-*.toml")):
        site = tomllib.loads(path.read_text())["site"]
        writable = [p.replace("%i", site["site_id"]) for p in _unit_values(agent, "ReadWritePaths")]
        assert site["state_dir"] in writable, path.name
        assert f"site-{site['site_id']}.toml" == path.name


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.timeout(60)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` on the units, with ExecStart pointed at this checkout's crossdc
    (verify insists that the binary exists) and the template instantiated as site "eu"."""
    crossdc = Path(sys.executable).parent / "crossdc"
    if not crossdc.exists():
        pytest.skip(f"{crossdc} is not installed (pip install -e .)")
    units = []
    for src in sorted(SYSTEMD.glob("*.service")):
        dst = tmp_path / src.name.replace("@.", "@eu.")
        dst.write_text(src.read_text().replace("/opt/crossdc/venv/bin/crossdc", str(crossdc)))
        units.append(dst)
    assert len(units) == 2
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", *map(str, units)], capture_output=True, text=True, timeout=45
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and "Failed to" in output and not any(u.name in output for u in units):
        pytest.skip(f"systemd-analyze verify cannot run here: {output.strip()[:300]}")
    assert proc.returncode == 0, output
    # Unknown keys and bad values are only warnings (exit 0): any line about our units fails.
    complaints = [ln for ln in output.splitlines() if any(u.name in ln for u in units)]
    assert not complaints, "\n".join(complaints)


# --------------------------------------------------------------------------------------------
# A real Prometheus scraping a live /metrics endpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, **params: str) -> Any:
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:  # 400/422 carry the error as JSON
        return json.loads(exc.read() or b"{}")


@dataclass
class LivePrometheus:
    url: str
    log: Path
    coordinator: CoordinatorMetrics
    site: SiteMetrics

    def api(self, path: str, **params: str) -> Any:
        return _get(f"{self.url}/api/v1/{path}", **params)

    def query(self, expr: str) -> Any:
        return self.api("query", query=expr)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _populate(coord: CoordinatorMetrics, site: SiteMetrics) -> None:
    """Give every declared metric a sample, with values that put some alerts into pending."""
    coord.rounds.inc(3)
    coord.rounds_aborted.inc()
    for seconds in (40.0, 75.0, 130.0):
        coord.round_duration.observe(seconds)
    coord.global_version.set(10)  # the site below holds version 3: CrossdcSiteBehind
    coord.quorum_size.set(2)
    coord.members.set(0)  # CrossdcNoMembers, CrossdcMembersBelowExpected
    coord.updates_accepted.labels(site="eu").inc(3)
    coord.rejected.labels(reason="stale_round").inc()
    for direction in ("in", "out"):
        coord.wire_bytes.labels(direction=direction).inc(1e6)
        coord.payload_raw_bytes.labels(direction=direction).inc(4e6)
        coord.payload_bytes.labels(direction=direction).inc(1e6)
    coord.update_size.observe(3e5)
    coord.outer_grad_norm.set(1.5)
    coord.val_loss.set(3.2)
    coord.train_loss.set(3.1)
    coord.late_updates.inc()
    coord.extra_steps.labels(site="eu").inc(12)
    coord.joins.inc(3)
    coord.site_timeouts.inc()
    site.inner(steps=20, tokens=20 * 8 * 32, seconds=12.0, loss=3.1)
    site.round_sent()
    site.val_loss(3.2)
    site.val_metrics({"accuracy": 0.5})
    site.nonfinite_step(7)
    site.global_version(3)
    site.utilization(0.5)  # CrossdcSiteLowComputeUtilization
    site.stalled(1.0)
    site.wire(sent=1_000_000, received=2_000_000)
    site.rejected("remote_stale_round")
    site.link(rtt_s=0.08, goodput_bytes_per_s=5e5, measured=True)  # CrossdcSiteGoodputLow
    now = time.time()
    site.certificate_expiry(now + 3 * DAY_S)  # CrossdcSiteCertificateExpiring
    # Site "eu"'s only certificate expires in 3 days (CrossdcCertificateExpiring); "us" has an
    # old one that does too, but a newer one it is renewed with (quiet: only the newest counts).
    certificates = [
        ("eu", "eu-1", now + 3 * DAY_S),
        ("us", "us-1", now + 2 * DAY_S),
        ("us", "us-2", now + 80 * DAY_S),
    ]
    coord.watch_certificates(lambda: certificates)
    coord.ca_expiry.set(now + 30 * DAY_S)  # CrossdcCACertificateExpiring
    coord.refused("wrong_credentials")
    site.refused("wrong_credentials")
    site.dp_epsilon(1.2)
    site.ef_norm(0.3)
    site.merge_delay(6)


def _tick(coord: CoordinatorMetrics, site: SiteMetrics, stop: threading.Event) -> None:
    """Counters that keep moving between scrapes, fast enough for the rate alerts."""
    while not stop.wait(0.2):
        site.stalled(60.0)  # CrossdcSiteSyncStallGrowing
        site.rejected("remote_stale_round")  # CrossdcSiteRejectedSurge
        site.inner(steps=1, tokens=256, seconds=0.1, loss=3.0)
        coord.rejected.labels(reason="stale_round").inc(5)  # CrossdcRejectedSurge
        coord.wire_bytes.labels(direction="in").inc(1e5)


# Alerts the fixture's values must put into pending (alertname, labels that must match).
EXPECTED_PENDING = [
    ("CrossdcNoMembers", {}),
    ("CrossdcMembersBelowExpected", {}),
    ("CrossdcSiteBehind", {"site": "eu"}),
    ("CrossdcSiteLowComputeUtilization", {"site": "eu"}),
    ("CrossdcSiteSyncStallGrowing", {"site": "eu"}),
    ("CrossdcSiteDown", {"site": "ap"}),
    ("CrossdcRejectedSurge", {"reason": "stale_round"}),
    ("CrossdcSiteRejectedSurge", {"site": "eu", "reason": "remote_stale_round"}),
    ("CrossdcSiteGoodputLow", {"site": "eu"}),
    ("CrossdcSiteCertificateExpiring", {"site": "eu"}),
    ("CrossdcCertificateExpiring", {"site": "eu", "job": "crossdc-coordinator"}),
    ("CrossdcCACertificateExpiring", {"job": "crossdc-coordinator"}),
]
# Alerts the fixture's values must not raise (alertname, labels of the alerts that must not be).
EXPECTED_QUIET = [
    ("CrossdcCoordinatorDown", {}),
    ("CrossdcNoRoundCompleted", {}),
    ("CrossdcValLossIncreasing", {}),
    ("CrossdcVersionMismatch", {}),  # both roles run this checkout's version
    ("CrossdcCertificateExpiring", {"site": "us"}),  # its newest certificate has 80 days left
]


def _matching(alerts: list[dict[str, Any]], name: str, labels: dict[str, str]) -> bool:
    return any(
        a["labels"].get("alertname") == name
        and all(a["labels"].get(k) == v for k, v in labels.items())
        for a in alerts
    )


def _wait(predicate: Any, what: str, prom: subprocess.Popen[bytes], log: Path) -> Any:
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


@pytest.fixture(scope="module")
def live_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LivePrometheus]:
    """Prometheus (the installed binary) scraping a coordinator and a site /metrics served in
    this process, with deploy/prometheus/alerts.yml loaded, after it has scraped three times and
    evaluated every rule."""
    assert PROMETHEUS is not None
    tmp = tmp_path_factory.mktemp("prometheus")
    coord, site = CoordinatorMetrics(), SiteMetrics("eu")
    _populate(coord, site)
    servers = [
        ObserveServer(registry=m.registry, status=dict, host="127.0.0.1", port=0)
        for m in (coord, site)
    ]
    stop = threading.Event()
    ticker = threading.Thread(target=_tick, args=(coord, site, stop), daemon=True)
    prom: subprocess.Popen[bytes] | None = None
    log = tmp / "prometheus.log"
    try:
        for server in servers:
            server.start()
        # YAML is a superset of JSON; the jobs mirror deploy/prometheus/prometheus.yml. Site "ap"
        # points at a closed port: a site target that is down.
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(ALERTS_YML)],
            "scrape_configs": [
                {
                    "job_name": "crossdc-coordinator",
                    "static_configs": [{"targets": [f"127.0.0.1:{servers[0].port}"]}],
                },
                {
                    "job_name": "crossdc-site",
                    "honor_labels": True,
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{servers[1].port}"], "labels": {"site": "eu"}},
                        {"targets": [f"127.0.0.1:{_free_port()}"], "labels": {"site": "ap"}},
                    ],
                },
            ],
        }
        (tmp / "prometheus.yml").write_text(json.dumps(config, indent=1))
        port = _free_port()
        with log.open("wb") as log_file:
            prom = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        live = LivePrometheus(f"http://127.0.0.1:{port}", log, coord, site)
        ticker.start()

        def scraped_three_times() -> bool:
            # Three samples of every target: enough for rate() and deriv() to have two points.
            res = live.query('min(count_over_time(up{job=~"crossdc-.*"}[1m]))')
            if res.get("status") != "success" or not res["data"]["result"]:
                return False
            targets = live.api("targets")["data"]["activeTargets"]
            return len(targets) == 3 and float(res["data"]["result"][0]["value"][1]) >= 3

        def rules_evaluated() -> bool:
            groups = live.api("rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return bool(rules) and all(not r["lastEvaluation"].startswith("0001") for r in rules)

        _wait(scraped_three_times, "three scrapes of every target", prom, log)
        _wait(rules_evaluated, "an evaluation of every rule", prom, log)
        yield live
    finally:
        stop.set()
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(timeout=15)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
        if ticker.is_alive():
            ticker.join(timeout=5)
        for server in servers:
            server.close()


@needs_prometheus
@pytest.mark.timeout(120)
def test_every_declared_metric_reaches_prometheus(live_prometheus: LivePrometheus) -> None:
    """Guard for the checks below: the live endpoint exposes every declared family, so an empty
    query result means a wrong query, not a missing sample."""
    res = live_prometheus.api("label/__name__/values")
    assert res["status"] == "success", res
    scraped = set(res["data"])
    wanted = {n for n in declared_series_names() if not n.endswith("_created")}
    assert not wanted - scraped, f"declared but not scraped: {sorted(wanted - scraped)}"


@needs_prometheus
@pytest.mark.timeout(120)
def test_dashboard_queries_run_on_prometheus(live_prometheus: LivePrometheus) -> None:
    failures = []
    for where, expr in dashboard_queries():
        res = live_prometheus.query(expr)
        if res.get("status") != "success":
            failures.append(f"{where}: {res.get('errorType')}: {res.get('error')}\n  {expr}")
        elif not res["data"]["result"]:
            failures.append(f"{where}: no series (wrong metric or label?)\n  {expr}")
    assert not failures, "\n".join(failures)


@needs_prometheus
@pytest.mark.timeout(120)
def test_dashboard_variables_have_values(live_prometheus: LivePrometheus) -> None:
    for name, selector, label in dashboard_variable_queries():
        res = live_prometheus.api(f"label/{label}/values", **{"match[]": selector})
        assert res["status"] == "success", f"${name}: {res}"
        assert res["data"], f"${name}: label_values({selector}, {label}) is empty"
    # Site metrics keep the agent's own `site` label next to the target label: no exported_site.
    res = live_prometheus.api("label/exported_site/values")
    assert res["status"] == "success" and res["data"] == [], res


@needs_prometheus
@pytest.mark.timeout(120)
def test_alert_rules_evaluate_on_prometheus(live_prometheus: LivePrometheus) -> None:
    groups = live_prometheus.api("rules")["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"] if r["type"] == "alerting"}
    assert set(loaded) == {r.name for r in alert_rules()}
    for name, rule in loaded.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
        assert rule["duration"] > 0, f"{name}: no for:"
        assert rule["labels"].get("severity") in SEVERITIES, name
        assert rule["annotations"].get("summary") and rule["annotations"].get("description")
        res = live_prometheus.query(rule["query"])
        assert res["status"] == "success", f"{name}: {res}"


@needs_prometheus
@pytest.mark.timeout(120)
def test_alerts_fire_on_matching_data(live_prometheus: LivePrometheus) -> None:
    """The fixture's values break some rules and not others: label matching (on/group_left,
    scalar, honor_labels) and rate windows behave as the rules intend."""

    def active() -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = live_prometheus.api("alerts")["data"]["alerts"]
        return alerts

    deadline = time.monotonic() + WAIT_S
    while True:
        alerts = active()
        missing = [(n, lab) for n, lab in EXPECTED_PENDING if not _matching(alerts, n, lab)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    got = sorted({(a["labels"]["alertname"], a["labels"].get("site", "")) for a in alerts})
    assert not missing, f"not pending: {missing}; active: {got}\n{live_prometheus.log_tail()}"
    for name, labels in EXPECTED_QUIET:
        assert not _matching(alerts, name, labels), f"{name} {labels} should not be active: {got}"
    for alert in alerts:
        for key, text in alert["annotations"].items():
            assert "error expanding template" not in text, f"{alert['labels']}: {key}: {text}"
            assert "<no value>" not in text, f"{alert['labels']}: {key}: {text}"
