"""Secure aggregation's keys: a site masks only with peers whose relayed certificate verifies
against its own kit, and the coordinator refuses at the join a session key no site could mask
with, while the other sites' masked rounds go on."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from comm.codecs.floats import Fp32Codec
from comm.security.kits import init_kit, issue_site
from comm.security.masking import Peer, SecAggConfig
from comm.security.secagg import SecAggSession
from comm.wire.schema import Error, ErrorCode, Global, InitParams, Join, RoundStart, Update
from comm.wire.tensors import encode_tensors
from site_agent.agent import SiteAgent
from site_agent.config import load_site_config
from site_agent.launch import build_job_trainer
from site_agent.payload import masked_payload
from tests.conftest import write_site_config
from tests.site_agent.test_secagg import RecordingLink, _round
from tests.support.coordinator import (
    PARAMS,
    Harness,
    Site,
    join,
    on_base,
    rejected,
    running,
)

pytestmark = pytest.mark.timeout(120)

SESSION_KEY = "secagg_session_public"
"""The join capability that announces a site's session key."""

SECAGG = {"clip_bound": 64.0}

# ---------------------------------------------------------------------------------------------
# The site's side: a relayed peer key without a valid certificate is refused by name


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The federation's kit with site kits for eu, us, ap and an expired one for us; and a
    kit of another CA (a coordinator's own) that also issued a certificate for us."""
    root = tmp_path_factory.mktemp("kits")
    fed, rogue = init_kit(root / "fed"), init_kit(root / "rogue")
    out = {"fed": fed}
    for site in ("eu", "us", "ap"):
        out[site] = issue_site(fed, site, days=1, out_dir=root / f"kit-{site}").site_kit_dir
    long_ago = time.time() - 5 * 86400
    out["us-expired"] = issue_site(
        fed, "us", days=1, out_dir=root / "kit-us-expired", now=long_ago
    ).site_kit_dir
    out["us-rogue"] = issue_site(rogue, "us", days=1, out_dir=root / "kit-us-rogue").site_kit_dir
    return out


def _pem(site_kit: Path) -> str:
    return (site_kit / "site.pem").read_text()


def _substitute(case: str, kits: dict[str, Path]) -> str:
    """What a coordinator relays for us in place of us's own certificate."""
    if case == "bare_key":  # the coordinator's own CURVE key, as a bare key
        return zmq.curve_keypair()[0].decode()
    if case == "other_ca":  # a certificate for us from a CA the site's kit does not hold
        return _pem(kits["us-rogue"])
    if case == "other_site":  # ap's genuine certificate relayed as us's
        return _pem(kits["ap"])
    assert case == "expired"
    return _pem(kits["us-expired"])


@pytest.mark.parametrize("case", ["bare_key", "other_ca", "other_site", "expired"])
def test_a_site_refuses_a_peer_key_the_coordinator_substituted(
    tmp_path: Path, kits: dict[str, Path], case: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_site_config(
        write_site_config(
            tmp_path,
            "eu",
            0,
            2,
            secure_aggregation=SECAGG,
            security={"kit_dir": str(kits["eu"])},
        )
    )
    assert cfg.secure_aggregation is not None
    link = RecordingLink()
    agent = SiteAgent(cfg, trainer=build_job_trainer(cfg), link=link)
    agent.start()
    agent.sender.open_session("s")
    stats = agent.trainer.train_steps(2)
    agent.sender.trained(1, stats.tokens)
    mine = agent.sender.join_capabilities()["secagg_session_public"]
    # The coordinator relays its own session key for us and, in place of us's certificate,
    # a key or certificate of its choosing.
    attacker = SecAggSession(site_id="us", session_id="s", config=cfg.secure_aggregation)
    forged = {
        "eu": [mine, _pem(kits["eu"])],
        "us": [attacker.session_public.hex(), _substitute(case, kits)],
    }
    agent._send_update(_round(1, {"attempt": 0, "peers": forged}), stats)
    assert link.sent == [], "the site masked with a key its kit does not certify"
    assert agent.sender.tokens_pending(0) == stats.tokens  # the progress stays for later
    refused = agent.metrics.registry.get_sample_value(
        "crossdc_site_rejected_total", {"site": "eu", "reason": "secagg_peer"}
    )
    assert refused == 1.0
    assert "peer 'us' refused" in caplog.text

    # Us's own certificate, relayed as it is: the masked update goes out.
    genuine = {**forged, "us": [attacker.session_public.hex(), _pem(kits["us"])]}
    agent._send_update(_round(2, {"attempt": 0, "peers": genuine}), stats)
    assert [type(m) for m in link.sent] == [Update]
    agent.close()


# ---------------------------------------------------------------------------------------------
# The coordinator's side: an unusable session key is refused at the join, by name

_P = 2**255 - 19
_ORDER_8 = 325606250916557431795983626356110631294008115727848805560023387167927233504


def _u(value: int) -> str:
    return value.to_bytes(32, "little").hex()


UNUSABLE_KEYS: dict[str, Any] = {
    "all_zero": _u(0),
    "order_4": _u(1),
    "order_8": _u(_ORDER_8),
    "non_canonical_zero": _u(_P),
    "31_bytes": bytes(range(1, 32)).hex(),
    "not_hex": "zz" * 32,
    "missing": None,
}


def _masked_update(session: SecAggSession, rs: RoundStart, delta: dict[str, np.ndarray]) -> Update:
    """What a site sends for ``rs``: ``delta`` masked with the plan's peers."""
    # Without certificates (an insecure loopback federation) each peer is [key hex, ""].
    attempt = rs.secagg["attempt"]
    peers = {s: Peer(session_public=bytes.fromhex(k[0])) for s, k in rs.secagg["peers"].items()}
    masked = session.mask(delta, round_id=rs.round_id, participants=peers, attempt=attempt)
    return replace(on_base(session.site_id, rs, delta), payload=masked_payload(masked, attempt))


def _join_masking(h: Harness, site: Site, cfg: SecAggConfig) -> SecAggSession:
    """``site`` joins announcing a fresh session key; its masking session."""
    key = SecAggSession(site_id=site.site_id, session_id="", config=cfg)
    welcome = join(h, site, capabilities={SESSION_KEY: key.session_public.hex()})
    return SecAggSession(
        site_id=site.site_id,
        session_id=welcome.session_id,
        config=cfg,
        session_key=key._session_key,
    )


@pytest.mark.parametrize("case", sorted(UNUSABLE_KEYS))
def test_an_unusable_session_key_is_refused_at_the_join_and_the_others_mask(case: str) -> None:
    cfg = SecAggConfig(**SECAGG)
    with running(secure_aggregation=cfg) as h:
        ap = h.site("ap")
        announced = UNUSABLE_KEYS[case]
        capabilities = {} if announced is None else {SESSION_KEY: announced}
        ap.send(
            Join(
                site_id="ap",
                model_fingerprint="fp",
                global_version=-1,
                state_hash="",
                capabilities=capabilities,
            )
        )
        err: Error = h.expect(ap, Error)
        assert err.code == int(ErrorCode.BAD_KEY), err.detail
        assert "site 'ap'" in err.detail and "session key" in err.detail
        assert rejected(h.coord, "bad_key") == 1.0
        assert "ap" not in h.coord.members

        # The other sites' masked round is not disturbed.
        eu, us = h.site("eu"), h.site("us")
        sessions = {"eu": _join_masking(h, eu, cfg)}
        eu.send(
            InitParams(
                site_id="eu",
                model_fingerprint="fp",
                payload=encode_tensors(PARAMS, Fp32Codec()),
            )
        )
        sessions["us"] = _join_masking(h, us, cfg)
        rs: RoundStart = h.expect(eu, RoundStart)
        assert sorted(rs.secagg["peers"]) == ["eu", "us"]
        deltas = {
            "eu": {"w": np.full((2, 3), 0.2, np.float32), "b": np.zeros(3, np.float32)},
            "us": {"w": np.full((2, 3), 0.6, np.float32), "b": np.ones(3, np.float32)},
        }
        for site in (eu, us):
            site.send(_masked_update(sessions[site.site_id], rs, deltas[site.site_id]))
        result: Global = h.expect(eu, Global)
        assert result.global_version == 1
        assert rejected(h.coord, "bad_payload") == 0.0
