"""deploy/'s monitoring against a real Prometheus: the installed binary scrapes a live coordinator
and site /metrics with deploy/prometheus/alerts.yml loaded; every declared metric arrives, the
dashboard's queries and variables return series, and the alerts fire on the data they should.
Also the guards for the readers the deploy tests share (tests/support/deploy.py).

The Prometheus config and rules without a running Prometheus, the Grafana dashboard and the
systemd units: test_deploy_prometheus.py, test_deploy_grafana.py, test_deploy_systemd.py."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from comm.ops.observe import ObserveServer
from coordinator.metrics import CoordinatorMetrics
from site_agent.metrics import SiteMetrics
from tests.support.deploy import (
    ALERTS_YML,
    DAY_S,
    PROMETHEUS,
    SEVERITIES,
    STANDARD_PREFIXES,
    WAIT_S,
    alert_rules,
    dashboard_queries,
    dashboard_variable_queries,
    declared_series_names,
    free_port,
    http_get,
    needs_prometheus,
    promql_metric_names,
    scrape_jobs,
    wait_prometheus,
)


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


@pytest.mark.timeout(30)
def test_file_readers_see_the_files() -> None:
    """Guard for the readers (tests/support/deploy.py): they find what a quick count of the raw
    text finds."""
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
# A real Prometheus scraping a live /metrics endpoint


@dataclass
class LivePrometheus:
    url: str
    log: Path
    coordinator: CoordinatorMetrics
    site: SiteMetrics

    def api(self, path: str, **params: str) -> Any:
        return http_get(f"{self.url}/api/v1/{path}", **params)

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
    coord.identity_conflicts.labels(site="eu")  # 0 from the join on; _tick counts conflicts
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
    # A CA rollover: the previous CA expires in 30 days (CrossdcCACertificateExpiring), the new
    # one in ten years.
    coord.watch_cas(
        lambda: [("00aa00aa00aa00aa", now + 30 * DAY_S), ("11bb11bb11bb11bb", now + 3650 * DAY_S)]
    )
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
        coord.identity_conflicts.labels(site="eu").inc()  # CrossdcIdentityConflict
        coord.trust_refused.labels(reason="dropped_ca").inc()  # CrossdcTrustReloadRefused
        site.trust_refused("bad_signature")  # CrossdcSiteTrustReloadRefused


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
    ("CrossdcCACertificateExpiring", {"job": "crossdc-coordinator", "ca": "00aa00aa00aa00aa"}),
    ("CrossdcIdentityConflict", {"site": "eu", "job": "crossdc-coordinator"}),
    ("CrossdcTrustReloadRefused", {"reason": "dropped_ca"}),
    ("CrossdcSiteTrustReloadRefused", {"site": "eu", "reason": "bad_signature"}),
]
# Alerts the fixture's values must not raise (alertname, labels of the alerts that must not be).
EXPECTED_QUIET = [
    ("CrossdcCoordinatorDown", {}),
    ("CrossdcNoRoundCompleted", {}),
    ("CrossdcValLossIncreasing", {}),
    ("CrossdcVersionMismatch", {}),  # both roles run this checkout's version
    ("CrossdcCertificateExpiring", {"site": "us"}),  # its newest certificate has 80 days left
    ("CrossdcCACertificateExpiring", {"ca": "11bb11bb11bb11bb"}),  # the new CA: ten years
]


def _matching(alerts: list[dict[str, Any]], name: str, labels: dict[str, str]) -> bool:
    return any(
        a["labels"].get("alertname") == name
        and all(a["labels"].get(k) == v for k, v in labels.items())
        for a in alerts
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
                        {"targets": [f"127.0.0.1:{free_port()}"], "labels": {"site": "ap"}},
                    ],
                },
            ],
        }
        (tmp / "prometheus.yml").write_text(json.dumps(config, indent=1))
        port = free_port()
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

        wait_prometheus(scraped_three_times, "three scrapes of every target", prom, log)
        wait_prometheus(rules_evaluated, "an evaluation of every rule", prom, log)
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
