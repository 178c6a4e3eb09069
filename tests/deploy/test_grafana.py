"""deploy/grafana: the dashboard's JSON, panels and queries (only declared metrics, covering the
design), and its provisioning."""

from __future__ import annotations

import re

import pytest

from tests.support.deploy import (
    GRAFANA_DASHBOARDS,
    GRAFANA_DATASOURCES,
    PROMETHEUS_SERIES,
    counter_function_arguments,
    counter_series_names,
    dashboard,
    dashboard_panels,
    dashboard_queries,
    dashboard_variable_queries,
    declared_series_names,
    promql_metric_names,
)


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
