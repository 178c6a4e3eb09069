"""deploy/prometheus without a running Prometheus: promtool checks the config and the alert
rules, every alert is complete and names only declared metrics, `promtool test rules` runs the
alerts whose logic is more than a threshold on synthetic series, and the scrape jobs match the
queries and the example configs."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.support.deploy import (
    ALERTS_YML,
    CONFIGS,
    DAY_S,
    PROMETHEUS_SERIES,
    PROMETHEUS_YML,
    PROMTOOL,
    SEVERITIES,
    alert_rules,
    counter_function_arguments,
    counter_series_names,
    dashboard_queries,
    declared_series_names,
    needs_promtool,
    promql_metric_names,
    scrape_jobs,
)


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
    # During a CA rollover both CAs are watched: the previous one expires soon, the new one not.
    "CrossdcCACertificateExpiring": (
        [
            (
                f'crossdc_ca_certificate_expiry_timestamp_seconds{{{_COORD},ca="{ca}"}}',
                f"{value:.0f}x20",
            )
            for ca, value in [
                ("00aa00aa00aa00aa", EVAL_S + 30 * DAY_S),
                ("11bb11bb11bb11bb", EVAL_S + 3650 * DAY_S),
            ]
        ],
        [(f'{{{_COORD},ca="00aa00aa00aa00aa"}}', 30 * DAY_S)],
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
