"""Two holders of one site key. A second connection that joins as a site whose current
connection still heartbeats is refused, the current one kept; the conflict is counted in
``crossdc_identity_conflicts_total{site}``, logged with both peers, and fires the alert that
tells the operator to revoke. A restarted site (its old connection closed, or silent for the
heartbeat timeout) rejoins as before, and nothing is counted.

The coordinator runs in this process with a real federation kit (CURVE, the ZAP handler,
certificates); both connections are real CURVE DEALERs holding the site's real key.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from comm.security.kits import init_kit, issue_site
from comm.security.rolekits import SecurityConfig, load_site_kit
from comm.transport.dealer import DealerChannel
from comm.transport.profile import ChannelConfig
from comm.wire.schema import Error, ErrorCode, Heartbeat, Join, Welcome
from coordinator.conflicts import ClaimVerdict, judge_claim
from coordinator.membership import Member
from tests.conftest import ROOT
from tests.support.coordinator import Harness, ManualClock, Site, heard, join, rejected, running
from tests.support.deploy import PROMTOOL, alert_rules, needs_promtool

pytestmark = pytest.mark.timeout(60)

HEARTBEAT_TIMEOUT_S = 5.0


class SecureSite(Site):
    """A site's connection with the CURVE keys of its real startup kit."""

    def __init__(self, h: Harness, kit_dir: Path, site_id: str) -> None:
        curve = load_site_kit(kit_dir, site_id=site_id).curve
        cfg = ChannelConfig(linger_s=0.1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, curve=curve)
        self.site_id = site_id
        self.chan = DealerChannel(cfg, identity=site_id, context=h.ctx)
        self.chan.connect(h.coord.endpoint)


class Federation:
    """The coordinator, its manual clock, and every site connection made (closed at the end)."""

    def __init__(self, h: Harness, clock: ManualClock, kits: Path) -> None:
        self.h, self.clock, self.kits = h, clock, kits
        self.sites: list[SecureSite] = []

    def connect(self, site_id: str = "eu") -> SecureSite:
        self.sites.append(SecureSite(self.h, self.kits / f"kit-{site_id}", site_id))
        return self.sites[-1]

    def close(self) -> None:
        for site in self.sites:
            site.chan.close(flush_timeout_s=0)

    def conflicts(self, site_id: str = "eu") -> float:
        value = self.h.coord.metrics.registry.get_sample_value(
            "crossdc_identity_conflicts_total", {"site": site_id}
        )
        return -1.0 if value is None else value


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[Federation]:
    root = init_kit(tmp_path / "kit")
    issue_site(root, "eu", days=30, out_dir=tmp_path / "kit-eu")
    clock = ManualClock()
    channel = ChannelConfig(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    security = SecurityConfig(kit_dir=str(root))
    with running(clock=clock, security=security, channel=channel) as h:
        federation = Federation(h, clock, tmp_path)
        try:
            yield federation
        finally:
            federation.close()


def _claim(h: Harness, site: SecureSite) -> Welcome | Error:
    """``site`` joins: the coordinator's answer, a Welcome or an Error."""
    site.send(Join(site_id=site.site_id, model_fingerprint="fp", global_version=-1, state_hash=""))
    for _ in range(400):
        h.coord.step(0.005)
        msg = site.chan.recv(0.0)
        if isinstance(msg, Welcome | Error):
            return msg
    raise AssertionError(f"{site.site_id} got no answer to its join")


def test_a_second_connection_with_the_sites_key_is_refused_counted_and_logged(
    fed: Federation, caplog: pytest.LogCaptureFixture
) -> None:
    h = fed.h
    eu = fed.connect()
    join(h, eu)
    assert fed.conflicts() == 0.0, "the counter exists from the join on"
    thief = fed.connect()  # the same certificate and CURVE key, another connection
    with caplog.at_level(logging.WARNING, logger="crossdc.coordinator"):
        refused = _claim(h, thief)
        assert isinstance(refused, Error) and refused.code == int(ErrorCode.UNAUTHENTICATED)
        assert "held by another connection" in refused.detail
        # The current connection is told, and stays the member.
        notice: Error = h.expect(eu, Error)
        assert notice.code == int(ErrorCode.UNEXPECTED) and "in other hands" in notice.detail
        assert h.coord.members["eu"].peer == eu.chan.routing_id
        assert rejected(h.coord, "identity_conflict") == 1.0
        # It heartbeats on: two live holders of one key, a conflict.
        assert heard(h, eu) == []
    assert fed.conflicts() == 1.0
    logged = [r.getMessage() for r in caplog.records if "identity conflict" in r.getMessage()]
    assert len(logged) == 1, logged
    for peer in (thief.chan.routing_id, eu.chan.routing_id):
        assert f"peer={peer.decode()} address=127.0.0.1 certificate=" in logged[0]
    assert "crossdc keys revoke --kit KIT --site eu" in logged[0]
    assert "serving the current one" in logged[0]
    # The newcomer's messages are not the member's, and each claim is refused again.
    thief.send(Heartbeat(site_id="eu", global_version=0, sent_at=1.0))
    assert h.expect(thief, Error).code == int(ErrorCode.NOT_JOINED)
    assert isinstance(_claim(h, thief), Error)
    assert fed.conflicts() == 1.0, "counted when the current connection is heard from again"
    assert [type(m) for m in heard(h, eu)] == [Error]  # the second notice, then the echo
    assert fed.conflicts() == 2.0
    assert h.coord.members["eu"].peer == eu.chan.routing_id


def test_a_join_again_on_the_same_connection_is_no_conflict(fed: Federation) -> None:
    h = fed.h
    eu = fed.connect()
    join(h, eu)
    assert isinstance(_claim(h, eu), Welcome)
    assert fed.conflicts() == 0.0 and rejected(h.coord, "identity_conflict") == 0.0


def test_a_restarted_site_whose_old_connection_closed_rejoins_at_once(fed: Federation) -> None:
    h = fed.h
    old = fed.connect()
    join(h, old)
    old.chan.close(flush_timeout_s=0)
    new = fed.connect()  # the restarted agent: the same key, a new connection
    assert isinstance(_claim(h, new), Welcome)  # no wait: the clock has not moved
    assert h.coord.members["eu"].peer == new.chan.routing_id
    assert fed.conflicts() == 0.0 and rejected(h.coord, "identity_conflict") == 0.0


def test_a_restarted_site_whose_old_connection_went_silent_rejoins(fed: Federation) -> None:
    """An old connection still open but silent (a host that vanished without closing it):
    the newcomer waits until that one is silent for the heartbeat timeout, then takes its
    place; the old one never spoke again, so no conflict is counted."""
    h = fed.h
    old = fed.connect()
    join(h, old)
    new = fed.connect()
    assert isinstance(_claim(h, new), Error)
    assert h.expect(old, Error).code == int(ErrorCode.UNEXPECTED)  # told of the claim
    fed.clock.now += HEARTBEAT_TIMEOUT_S
    assert isinstance(_claim(h, new), Welcome)
    assert h.coord.members["eu"].peer == new.chan.routing_id
    assert fed.conflicts() == 0.0 and rejected(h.coord, "identity_conflict") == 1.0
    # The replaced connection is no member any more.
    old.send(Heartbeat(site_id="eu", global_version=0, sent_at=1.0))
    assert h.expect(old, Error).code == int(ErrorCode.NOT_JOINED)
    assert fed.conflicts() == 0.0


def _member(peer: bytes, last_seen: float) -> Member:
    return Member("eu", peer, joined_at=0.0, last_seen=last_seen, global_version=0, in_sync=True)


@pytest.mark.parametrize(
    ("member", "verdict"),
    [
        (None, ClaimVerdict.NEW),
        (_member(b"eu/new", 99.0), ClaimVerdict.SAME),
        (_member(b"eu/old", 99.0), ClaimVerdict.CONTESTED),
        (_member(b"eu/old", 100.0 - HEARTBEAT_TIMEOUT_S + 0.01), ClaimVerdict.CONTESTED),
        (_member(b"eu/old", 100.0 - HEARTBEAT_TIMEOUT_S), ClaimVerdict.REPLACES),
    ],
)
def test_judge_claim(member: Member | None, verdict: ClaimVerdict) -> None:
    got, why = judge_claim(100.0, member, b"eu/new", HEARTBEAT_TIMEOUT_S)
    assert got is verdict and why


def _render(template: str, labels: dict[str, str]) -> str:
    """An annotation as Prometheus expands it (these use only ``{{ $labels.NAME }}``)."""
    assert "$value" not in template
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)


@needs_promtool
def test_the_counted_conflict_fires_the_alert(fed: Federation, tmp_path: Path) -> None:
    """The counter's values from a real conflict, as Prometheus would scrape them a minute
    apart, fire CrossdcIdentityConflict for the site (promtool test rules)."""
    assert PROMTOOL is not None
    h = fed.h
    eu = fed.connect()
    join(h, eu)
    scraped = [fed.conflicts()]
    assert isinstance(_claim(h, fed.connect()), Error)
    heard(h, eu)
    scraped.append(fed.conflicts())
    assert scraped == [0.0, 1.0]
    rule = next(r for r in alert_rules() if r.name == "CrossdcIdentityConflict")
    labels = {"job": "crossdc-coordinator", "instance": "c:9710", "site": "eu"}
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    series = f"crossdc_identity_conflicts_total{{{selector}}}"
    values = " ".join(f"{v:.0f}" for v in scraped) + f" {scraped[-1]:.0f}x10"
    tests = {
        "rule_files": [str(ROOT / "deploy/prometheus/alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": series, "values": values}],
                "alert_rule_test": [
                    {
                        "eval_time": "5m",
                        "alertname": rule.name,
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": rule.fields["severity"], **labels},
                                "exp_annotations": {
                                    key: _render(rule.fields[key].strip('"'), labels)
                                    for key in ("summary", "description")
                                },
                            }
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "conflict-alert-test.yml"
    path.write_text(json.dumps(tests, indent=1))
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=45
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
