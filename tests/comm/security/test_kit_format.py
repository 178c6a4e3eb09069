"""A kit of format 1 (crossdc's own one-line certificates, before X.509) is refused: every command
and every role says which format it is and that the kit must be made again with ``crossdc keys``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comm.security.common import CA_CERT, CRL, MANIFEST, SITE_CERT, SITES_DIR
from comm.security.kits import init_kit, issue_site, revoke_site
from comm.security.registry import CertificateRegistry
from comm.security.rolekits import load_coordinator_kit, load_site_kit
from comm.security.rollover import retire_ca, rotate_ca
from crossdc import cli

REFUSED = r"format-1 kit.*no longer reads it.*crossdc keys init.*crossdc keys issue"


def _as_format1(kit: Path) -> None:
    """Lay a kit out the way format 1 did: ``ca.pub`` instead of ``ca.pem``, ``"format": 1``."""
    (kit / CA_CERT).rename(kit / "ca.pub")
    (kit / CRL).rename(kit / "revoked.list")
    manifest = json.loads((kit / MANIFEST).read_text())
    (kit / MANIFEST).write_text(json.dumps({**manifest, "format": 1}))
    site = kit / SITES_DIR / "eu"
    (site / SITE_CERT).rename(site / "site.cert")
    (site / CA_CERT).rename(site / "ca.pub")


@pytest.mark.timeout(60)
def test_a_format1_kit_is_refused_naming_its_format_and_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kit = init_kit(tmp_path / "kit")
    issue_site(kit, "eu", 30)
    _as_format1(kit)
    for load in (load_coordinator_kit, CertificateRegistry.from_kit):
        with pytest.raises(ValueError, match=REFUSED):
            load(kit)
    with pytest.raises(ValueError, match=REFUSED.replace("kit", "site kit", 1)):
        load_site_kit(kit / SITES_DIR / "eu")
    with pytest.raises(ValueError, match=REFUSED):
        issue_site(kit, "us", 30)
    with pytest.raises(ValueError, match=REFUSED):
        revoke_site(kit, "eu")
    for roll in (rotate_ca, retire_ca):
        with pytest.raises(ValueError, match=REFUSED):
            roll(kit)
    assert cli.main(["keys", "issue", "--kit", str(kit), "--site", "us"]) == 2
    err = capsys.readouterr().err
    assert "format-1 kit" in err and "crossdc keys issue" in err
    # There is no command that converts such a kit any more.
    with pytest.raises(SystemExit) as exc:
        cli.main(["keys", "migrate", "--kit", str(kit)])
    assert exc.value.code == 2
    assert "invalid choice: 'migrate'" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_kit_of_an_unknown_format_is_refused_naming_the_one_read(tmp_path: Path) -> None:
    kit = init_kit(tmp_path / "kit")
    manifest = json.loads((kit / MANIFEST).read_text())
    (kit / MANIFEST).write_text(json.dumps({**manifest, "format": 9}))
    with pytest.raises(ValueError, match="has kit format 9; this crossdc reads 2"):
        issue_site(kit, "eu", 30)
