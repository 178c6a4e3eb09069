"""``crossdc bench scale`` on a small case: a real coordinator process, simulated sites."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comm.codecs.registry import get_codec
from comm.ops.configio import dump_toml
from coordinator.config import CoordinatorConfig, load_coordinator_config
from crossdc.bench import scale
from crossdc.bench.scale_sites import Layout

pytestmark = pytest.mark.timeout(300)


def test_a_small_case_runs_every_round_and_refuses_nothing(tmp_path: Path) -> None:
    out = scale.run_case(3, 100_000, 2, tmp_path / "case", timeout_s=240)
    assert out["rounds"] == 2 and out["messages_refused"] == 0
    assert len(out["round_close_seconds"]) == 2
    assert out["coordinator_peak_rss_bytes"] > 0
    # Every byte on the coordinator's socket: at least θ0 up once, and per round three int4
    # updates up and three int4 results down (about half a byte per value each).
    assert out["wan_bytes_total"] >= 4 * 100_000 + 2 * 6 * 100_000 // 2
    assert out["wan_bytes_per_round"] == out["wan_bytes_total"] / 2
    (shard,) = out["shards"]  # one coordinator process
    # The peak is the high-water mark (VmHWM), the base the resident size then (VmRSS): a model
    # of 100K parameters can fit in what start-up already touched, so they may be equal.
    assert 0 < shard["base_rss_bytes"] <= shard["peak_rss_bytes"]
    assert shard["peak_rss_bytes"] == out["coordinator_peak_rss_bytes"]
    per_param = (shard["peak_rss_bytes"] - shard["base_rss_bytes"]) / 100_000
    assert shard["bytes_per_param"] == round(per_param, 2)
    # Three sites' updates in each of two rounds, every value folded once, in measured CPU time.
    assert shard["fold_parameter_updates"] == 3 * 2 * 100_000
    assert 0 < shard["fold_cpu_seconds"] <= shard["cpu_seconds"]
    assert shard["fold_rate"] == round(3 * 2 * 100_000 / shard["fold_cpu_seconds"])
    assert shard["round_close_seconds"] == out["round_close_seconds"]
    # int4 both ways and DiLoCo: θ, momentum and downlink residual kept, three int4 updates
    # held and the int4 broadcast.
    int4 = get_codec("int4").encoded_size(1 << 20) / (1 << 20)
    assert shard["budget_bytes_per_param"] == 12 + 4 * int4
    cfg = load_coordinator_config(tmp_path / "case" / "coordinator.toml")
    tolerance = scale.tolerance_bytes(cfg, 100_000) / 100_000
    assert shard["within_budget"] == (per_param <= 12 + 4 * int4 + tolerance)
    # Every simulated site took every result and ends on the coordinator's state hash.
    assert out["sites_on_final_hash"] == 3
    assert out["bench_peak_rss_bytes"] > 0
    assert not list((tmp_path / "case" / "sites").iterdir())  # θ's, θ0's and updates' files
    log = (tmp_path / "case" / "coordinator.log").read_text()
    assert "sent full model" not in log  # the other sites proved θ0 by hash


def test_the_budget_and_its_tolerance_follow_the_configuration(tmp_path: Path) -> None:
    def config(**changes: object) -> CoordinatorConfig:
        table = scale.coordinator_table(tmp_path, sites=3, rounds=2, port=1)
        path = tmp_path / "coordinator.toml"
        path.write_text(dump_toml({"coordinator": {**table, **changes}}))
        return load_coordinator_config(path)

    int4 = get_codec("int4").encoded_size(1 << 20) / (1 << 20)  # 0.53 bytes a value
    assert scale.budget_bytes_per_param(config(), 3) == 12 + 3 * int4 + int4
    # Two rounds open: each holds an update per site, neither keeps a sum.
    assert scale.budget_bytes_per_param(config(overlap=True), 3) == 12 + 6 * int4 + int4
    assert scale.budget_bytes_per_param(config(), 8) == 12 + 8 * int4 + int4
    largest = 1 << 22
    fixed = (1 << 30) + scale.CLOSE_TEMPORARIES * 4 * largest
    assert scale.tolerance_bytes(config(), largest) == fixed
    small = config(channel={"receive_budget_bytes": 1 << 20})
    assert scale.tolerance_bytes(small, largest) == fixed - (1 << 30) + (1 << 20)


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert scale.main(["--sites", "two"]) == 2
    assert scale.main(["--params", "0"]) == 2
    assert "crossdc bench scale" in capsys.readouterr().err


def test_a_case_on_two_shards_takes_theta0_from_a_site_and_ends_on_the_whole_hash(
    tmp_path: Path,
) -> None:
    # Two tensors (4M and 1.8M values): one per shard.
    numel = 6_000_000
    out = scale.run_case(3, numel, 2, tmp_path / "case", timeout_s=240, shards=2)
    assert out["rounds"] == 2 and out["messages_refused"] == 0
    assert len(out["round_close_seconds"]) == 2
    first, second = out["shards"]  # one entry per process, shard 0 first
    sizes = Layout.of(numel).sizes
    assert (first["params"], second["params"]) == (sizes[0], sizes[1])
    for shard in (first, second):
        assert 0 < shard["base_rss_bytes"] <= shard["peak_rss_bytes"]
        per_param = (shard["peak_rss_bytes"] - shard["base_rss_bytes"]) / shard["params"]
        assert shard["bytes_per_param"] == round(per_param, 2)
        # Each shard folds three sites' parts of its own tensors in each of two rounds.
        assert shard["fold_parameter_updates"] == 3 * 2 * shard["params"]
        assert shard["round_close_seconds"] == out["round_close_seconds"]
    assert out["coordinator_peak_rss_bytes"] == max(s["peak_rss_bytes"] for s in out["shards"])
    # Every site applied every result put together from both shards, on the whole model's hash.
    assert out["sites_on_final_hash"] == 3
    statuses = [
        json.loads((tmp_path / "case" / "coordinator" / f"shard-{i}" / "status.json").read_text())
        for i in range(2)
    ]
    assert statuses[0]["state_hash"] == statuses[1]["state_hash"]
    assert statuses[0]["shard_hash"] != statuses[1]["shard_hash"]
    assert not list((tmp_path / "case" / "sites").iterdir())


def test_more_shards_than_tensors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert scale.main(["--params", "1000000", "--shards", "2"]) == 2
    assert "fewer than 2 shards" in capsys.readouterr().err
