"""The site memory benchmark's report, on a small model (the figures at 200M parameters are in
docs/pipelines.md). RSS is not asserted against a bound here: at this size torch's own libraries
dominate it; what is asserted is that both sites ran their two syncs through the site's code and
the report holds every figure."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(240)


def test_site_memory_benchmark_report(capsys: pytest.CaptureFixture[str]) -> None:
    from crossdc.bench.site_memory import WIDTH, main

    assert main(["--params", str(WIDTH * WIDTH), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == WIDTH * WIDTH + WIDTH and out["ranks"] == 2
    assert out["model_bytes"] == 4 * out["params"]
    sites = [out["one_process"], *out["fsdp_ranks"]]
    assert len(sites) == 3
    for site in sites:
        assert site["peak_rss_bytes"] >= site["base_rss_bytes"] > 0
        assert len(site["sync_growth_bytes"]) == 2
    leader = out["fsdp_ranks"][0]["peak_rss_bytes"]
    assert out["leader_rss_ratio"] == leader / out["one_process"]["peak_rss_bytes"]
    growth = [g / out["model_bytes"] for r in out["fsdp_ranks"] for g in r["sync_growth_bytes"]]
    assert len(out["sync_growth_over_model"]) == 2
    assert out["max_sync_growth_over_model"] == max(out["sync_growth_over_model"]) == max(growth)


def test_site_memory_benchmark_refuses_a_model_smaller_than_a_layer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from crossdc.bench.site_memory import main

    assert main(["--params", "1000"]) == 2
    assert "--params must be" in capsys.readouterr().out
