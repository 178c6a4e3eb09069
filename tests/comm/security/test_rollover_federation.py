"""A CA rollover on a live federation: rounds keep closing from the new CA's arrival to the old
CA's retirement, and nothing restarts.

The coordinator, with a real federation kit (CURVE + ZAP + certificates), runs in this process
on the kit directory the rollover rewrites; the two sites run as processes on their own kits,
into which each one's new files are copied, one site after the other. Every wait polls real
state (the coordinator's metrics and registry, the sites' status files) with a deadline.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from comm.security.certs import make_site_certificate
from comm.security.common import CERTS_DIR, PREVIOUS_CA_KEY
from comm.security.kits import init_kit, issue_site
from comm.security.rolekits import SecurityConfig
from comm.security.rollover import retire_ca, rotate_ca
from comm.security.signing import load_private_key
from comm.wire.frames import to_wire
from comm.wire.schema import Join
from coordinator.config import CoordinatorConfig
from coordinator.service import Coordinator
from tests.conftest import Procs, wait_for, write_site_config

pytestmark = pytest.mark.timeout(480)

SITES = ("eu", "us")


@pytest.fixture
def kit(tmp_path: Path) -> Path:
    root = init_kit(tmp_path / "kit")
    for site in SITES:
        issue_site(root, site, days=30, out_dir=tmp_path / f"kit-{site}")
    return root


@pytest.fixture
def coordinator(tmp_path: Path, kit: Path) -> Iterator[Coordinator]:
    cfg = CoordinatorConfig(
        bind="tcp://127.0.0.1:0",
        state_dir=str(tmp_path / "coordinator"),
        metrics_port=0,
        min_sites=2,
        num_inner_steps=10,
        max_rounds=100_000,  # it runs until the test is done with it
        uplink_codec="int8",
        downlink_codec="int8",
        security=SecurityConfig(kit_dir=str(kit)),
    )
    coord = Coordinator(cfg)
    coord.start()
    stop = threading.Event()
    thread = threading.Thread(target=coord.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield coord
    finally:
        stop.set()
        thread.join(timeout=30)
        coord.close()


class Client:
    """A raw CURVE DEALER with a key of our choosing; closed by the fixture that made it."""

    def __init__(
        self, ctx: zmq.Context[Any], coord: Coordinator, kit: Path, public: bytes, secret: bytes
    ) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, f"ap/{os.urandom(8).hex()}".encode())
        self.sock.setsockopt(
            zmq.CURVE_SERVERKEY, (kit / "coordinator.curve.pub").read_bytes().strip()
        )
        self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.sock.connect(coord.endpoint)

    def join(self) -> None:
        msg = Join(site_id="ap", model_fingerprint="x", global_version=-1, state_hash="")
        with contextlib.suppress(zmq.Again):  # a refused handshake leaves no pipe to queue on
            self.sock.send_multipart(to_wire(msg, session="ap", seq=1), zmq.NOBLOCK)

    def answered(self) -> bool:
        """A reply came: the handshake was accepted (the answer itself refuses the model)."""
        return bool(self.sock.poll(0))

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def clients(coordinator: Coordinator, kit: Path) -> Iterator[Any]:
    ctx: zmq.Context[Any] = zmq.Context()
    made: list[Client] = []

    def make(public: bytes, secret: bytes) -> Client:
        made.append(Client(ctx, coordinator, kit, public, secret))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            c.close()
        ctx.destroy(linger=0)


def _sample(coord: Coordinator, name: str, labels: dict[str, str] | None = None) -> float:
    return coord.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def _rounds(coord: Coordinator) -> float:
    return _sample(coord, "crossdc_rounds_total")


def _more_rounds(procs: Procs, coord: Coordinator, n: int, what: str) -> None:
    """Wait until ``n`` more rounds closed, every process alive."""
    target = _rounds(coord) + n
    wait_for(
        lambda: _rounds(coord) >= target, timeout_s=120, what=f"{n} rounds {what}", procs=procs
    )


def _site_certificate(tmp_path: Path, site: str) -> dict[str, Any] | None:
    try:
        status = json.loads((tmp_path / f"site-{site}" / "status.json").read_text())
    except (OSError, ValueError):
        return None
    cert: dict[str, Any] | None = status.get("certificate")
    return cert


def _runs_with(tmp_path: Path, site: str, serial: str) -> bool:
    """The site runs with the certificate of this serial, as its status file says."""
    return (_site_certificate(tmp_path, site) or {}).get("serial") == serial


def _ca_expiries(coord: Coordinator) -> dict[str, float]:
    (family,) = [
        f
        for f in coord.metrics.registry.collect()
        if f.name == "crossdc_ca_certificate_expiry_timestamp_seconds"
    ]
    return {s.labels["ca"]: s.value for s in family.samples}


def test_a_live_federation_rolls_over_to_a_new_ca_without_losing_a_round(
    procs: Procs, tmp_path: Path, kit: Path, coordinator: Coordinator, clients: Any
) -> None:
    coord = coordinator
    registry = coord.registry
    assert registry is not None
    for i, site in enumerate(SITES):
        path = write_site_config(
            tmp_path,
            site,
            i,
            len(SITES),
            coordinator=coord.endpoint,
            coordinator_endpoint_file="",
            security={"kit_dir": str(tmp_path / f"kit-{site}")},
        )
        procs.start(f"site-{site}", "agent", "--config", str(path))
    wait_for(
        lambda: set(coord.members) == set(SITES), timeout_s=180, what="both sites", procs=procs
    )
    _more_rounds(procs, coord, 2, "before the rollover")
    (old_ca,) = registry.trusted_cas()

    # The new CA: issued, trusted beside the old one by the running coordinator.
    rolled = rotate_ca(kit)
    wait_for(
        lambda: len(registry.trusted_cas()) == 2,
        timeout_s=30,
        what="the coordinator to trust both CAs",
    )
    assert _ca_expiries(coord) == {
        rolled.ca.fingerprint: rolled.ca.not_after,
        old_ca.fingerprint: old_ca.not_after,
    }
    _more_rounds(procs, coord, 2, "with both CAs trusted")

    # A certificate the old CA issues during the overlap (another tool, from previous-ca.key)
    # for a key of its own: accepted while the old CA is trusted.
    public, secret = zmq.curve_keypair()
    lone = make_site_certificate(
        load_private_key(kit / PREVIOUS_CA_KEY),
        site_id="ap",
        curve_public=public,
        not_before=int(time.time()) - 300,
        not_after=int(time.time()) + 86400,
        serial="a0" * 16,
    )
    (kit / CERTS_DIR / f"ap-{lone.serial}.pem").write_bytes(lone.to_pem())
    wait_for(
        lambda: registry.certificate(lone.serial) is not None,
        timeout_s=30,
        what="the coordinator to load ap's certificate",
    )
    during = clients(public, secret)
    during.join()
    wait_for(during.answered, timeout_s=30, what="ap's handshake under the old CA")

    # Each site moves to its new certificate in turn, its agent running on.
    for site in SITES:
        bundle, certificate = rolled.site_files[site]
        site_kit = tmp_path / f"kit-{site}"
        shutil.copy(bundle, site_kit / bundle.name)
        shutil.copy(certificate, site_kit / certificate.name)
        new_serial = next(c.serial for c in rolled.certificates if c.site_id == site)
        wait_for(
            functools.partial(_runs_with, tmp_path, site, new_serial),
            timeout_s=60,
            what=f"site {site} to load its new certificate",
            procs=procs,
        )
        assert _site_certificate(tmp_path, site) == {
            "serial": new_serial,
            "not_after": next(c.not_after for c in rolled.certificates if c.site_id == site),
            "ca": rolled.ca.fingerprint,
            "trusted_cas": [rolled.ca.fingerprint, old_ca.fingerprint],
        }
        _more_rounds(procs, coord, 1, f"after site {site} moved")

    # The end of the overlap: ap holds an old certificate only, so retiring needs --force.
    with pytest.raises(ValueError, match="would lock out ap"):
        retire_ca(kit)
    retired = retire_ca(kit, force=True)
    assert lone.serial in retired.revoked
    wait_for(
        lambda: registry.trusted_cas() == (rolled.ca,),
        timeout_s=30,
        what="the coordinator to retire the old CA",
    )
    assert _ca_expiries(coord) == {rolled.ca.fingerprint: rolled.ca.not_after}
    # The sites' connections, opened under the old CA, go on: their keys hold new certificates.
    _more_rounds(procs, coord, 2, "after the old CA is retired")
    assert set(coord.members) == set(SITES)

    # The certificate of the old CA only is refused at the handshake, as revoked.
    revoked = _sample(coord, "crossdc_rejected_total", {"reason": "revoked"})
    after = clients(public, secret)
    after.join()
    wait_for(
        lambda: _sample(coord, "crossdc_rejected_total", {"reason": "revoked"}) > revoked,
        timeout_s=30,
        what="ap refused as revoked",
    )
    assert not after.answered()
    _more_rounds(procs, coord, 1, "after ap was refused")

    # Nothing was lost or refused on the way, and nobody restarted.
    assert _sample(coord, "crossdc_rounds_aborted_total") == 0
    assert registry.refused == {}
    assert _sample(coord, "crossdc_joins_total") == len(SITES)
    for site in SITES:
        assert procs.procs[f"site-{site}"].poll() is None
        assert "refused the kit" not in procs.log(f"site-{site}")
