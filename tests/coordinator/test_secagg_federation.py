"""Secure aggregation in a running federation: exact sums, and the dropout re-run rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from comm.security.kits import issue_site
from coordinator.file_store import FileStateStore
from tests.conftest import Procs, read_status, write_coordinator_config, write_site_config

pytestmark = pytest.mark.timeout(300)

SECAGG = {"clip_bound": 64.0}


def _run(
    procs: Procs,
    root: Path,
    *,
    secagg: bool,
    sites: int = 2,
    drop: str = "",
    kit: Path | None = None,
    **coord: object,
) -> dict:
    """A federation of ``sites`` processes; with ``kit``, in CURVE mode with certificates."""
    root.mkdir()
    procs.workdir = root
    extra = {"secure_aggregation": SECAGG} if secagg else {}
    coord.setdefault("max_rounds", 3)
    if kit is not None:
        coord["security"] = {"kit_dir": str(kit)}
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
        if kit is not None:
            site_kit = issue_site(kit, site, days=1, out_dir=root / f"kit-{site}").site_kit_dir
            fault["security"] = {"kit_dir": str(site_kit)}
        path = write_site_config(root, site, i, sites, **extra, **fault)
        procs.start(f"site-{site}-{tag}", "agent", "--config", str(path))
    assert procs.procs[f"coordinator-{tag}"].wait(timeout=240) == 0, procs.log(f"coordinator-{tag}")
    status = read_status(root)
    assert status is not None
    return status


def test_secure_agg_federation_trains_like_plain_sums(procs: Procs, tmp_path: Path) -> None:
    # One round from the same θ0 with the same site updates (deterministic single-threaded
    # training): the masked mean and the plain mean may differ only by rounding. Later rounds
    # would amplify that rounding through training, so the comparison is on θ1 itself.
    plain = _run(procs, tmp_path / "plain", secagg=False, max_rounds=1)
    masked = _run(procs, tmp_path / "masked", secagg=True, max_rounds=1)
    log = procs.log("coordinator-masked")
    assert "masked update accepted" in log
    vals_masked = {int(k): v for k, v in masked["val_losses"].items()}
    assert vals_masked[1] < vals_masked[0]
    assert plain["global_version"] == masked["global_version"] == 1
    theta_plain = FileStateStore(tmp_path / "plain" / "coordinator").load()
    theta_masked = FileStateStore(tmp_path / "masked" / "coordinator").load()
    assert theta_plain is not None and theta_masked is not None
    # Error sources, per element: the fixed-point encoding rounds each site's value by at most
    # 2^-(frac_bits+1), so the mean of n weight-1 sites is off by at most 2^-(frac_bits+1);
    # the plain mean accumulates n float32 products of values bounded by clip_bound, each
    # rounded by at most half an ulp; θ1 = θ0 - mean rounds once more in float32.
    eps = float(np.finfo(np.float32).eps)
    sites = 2
    atol = 2.0 ** -(32 + 1) + 2 * sites * eps * SECAGG["clip_bound"]
    for name, value in theta_plain.params.items():
        np.testing.assert_allclose(theta_masked.params[name], value, rtol=eps, atol=atol)
    # The bound is meaningful: the round moved the model by far more than it.
    with np.load(tmp_path / "plain" / "coordinator" / "global-v00000000.npz") as npz:
        moved = max(
            float(np.max(np.abs(theta_plain.params[n] - npz[f"p/{n}"]))) for n in theta_plain.params
        )
    assert moved > 100 * atol


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


def test_a_lost_rerun_plan_is_sent_again_by_the_channel_not_after_a_deadline(
    procs: Procs, tmp_path: Path
) -> None:
    # The re-run plan of round 2 to its first survivor is lost after the socket accepted it. The
    # round deadline (600 s) is beyond the coordinator's wait (240 s): the round can only close
    # because the channel sent the plan again on a missing acknowledgement.
    status = _run(
        procs,
        tmp_path / "lost",
        secagg=True,
        sites=3,
        drop="ap",
        site_timeout_s=3.0,
        max_rounds=2,
        round_deadline_s=600.0,
        faults={"lose_rerun_plan": 2},
    )
    assert status["rounds_completed"] == 2
    rounds = {h["round_id"]: h for h in status["history"]}
    assert rounds[2]["merged"] == ["eu", "us"]
    log = procs.log("coordinator-lost")
    assert "fault injection: the re-run plan to eu is lost" in log
    assert "(RoundStart) after 1 send(s): sending it again" in log


def test_secure_agg_with_certificates_masks_with_verified_peers(
    procs: Procs, tmp_path: Path, kit: Path
) -> None:
    # CURVE mode: the coordinator relays each peer's certificate and every site verifies it
    # against its own kit before masking.
    status = _run(procs, tmp_path / "certified", secagg=True, kit=kit, max_rounds=2)
    assert status["rounds_completed"] == 2
    assert "masked update accepted" in procs.log("coordinator-certified")
    for site in ("eu", "us"):
        assert "not masking" not in procs.log(f"site-{site}-certified")
