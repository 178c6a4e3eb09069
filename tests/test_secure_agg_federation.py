"""Secure aggregation in a running federation: exact sums, and the dropout re-run rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Procs, read_status, write_coordinator_config, write_site_config

pytestmark = pytest.mark.timeout(300)

SECAGG = {"clip_bound": 64.0}


def _run(
    procs: Procs, root: Path, *, secagg: bool, sites: int = 2, drop: str = "", **coord: object
) -> dict:
    root.mkdir()
    procs.workdir = root
    extra = {"secure_aggregation": SECAGG} if secagg else {}
    coord.setdefault("max_rounds", 3)
    cfg = write_coordinator_config(
        root,
        min_sites=sites,
        uplink_codec="fp32",
        downlink_codec="fp32",
        overlap=False,
        **extra,
        **coord,
    )
    tag = root.name
    procs.start(f"coordinator-{tag}", "coordinator", "--config", str(cfg))
    names = ["eu", "us", "ap"][:sites]
    for i, site in enumerate(names):
        fault = {"fault_exit_before_send_round": 2} if site == drop else {}
        path = write_site_config(root, site, i, sites, **extra, **fault)
        procs.start(f"site-{site}-{tag}", "agent", "--config", str(path))
    assert procs.procs[f"coordinator-{tag}"].wait(timeout=240) == 0, procs.log(f"coordinator-{tag}")
    status = read_status(root)
    assert status is not None
    return status


def test_secure_agg_federation_trains_like_plain_sums(procs: Procs, tmp_path: Path) -> None:
    plain = _run(procs, tmp_path / "plain", secagg=False)
    masked = _run(procs, tmp_path / "masked", secagg=True)
    log = procs.log("coordinator-masked")
    assert "masked update accepted" in log
    vals_plain = {int(k): v for k, v in plain["val_losses"].items()}
    vals_masked = {int(k): v for k, v in masked["val_losses"].items()}
    assert vals_masked[3] < vals_masked[0]
    # Masks cancel exactly; only the 2^-32 fixed-point rounding separates the two runs.
    assert vals_masked[3] == pytest.approx(vals_plain[3], rel=1e-4)


def test_secure_agg_dropout_after_masking_reruns_with_survivors(
    procs: Procs, tmp_path: Path
) -> None:
    # Two rounds: after "ap" is gone, fewer than min_sites remain for a third.
    status = _run(
        procs, tmp_path / "drop", secagg=True, sites=3, drop="ap", site_timeout_s=3.0, max_rounds=2
    )
    assert status["rounds_completed"] == 2
    rounds = {h["round_id"]: h for h in status["history"]}
    assert rounds[1]["merged"] == ["ap", "eu", "us"]
    assert rounds[2]["merged"] == ["eu", "us"], "round 2 was re-run with the survivors"
    log = procs.log("coordinator-drop")
    assert "re-run with 2 survivors" in log
    assert "secure aggregation re-run, attempt 1" in procs.log("site-eu-drop")
