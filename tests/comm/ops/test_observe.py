"""TLS and basic auth on the /metrics and /status port (comm/ops/httpsec.py, comm/ops/observe.py):
config checks, files that cannot be used, refusals and their counters, a handshake that stalls,
and a real Prometheus scraping both roles over HTTPS with basic auth."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from comm.ops.configio import ConfigError, build
from comm.ops.httpsec import HttpSecurityConfig
from comm.ops.observe import ObserveServer, crossdc_version
from comm.security.certs import load_ca_certificate
from comm.security.common import CA_CERT
from comm.security.kits import init_kit, issue_site, revoke_site
from comm.security.rolekits import SecurityConfig
from coordinator.config import CoordinatorConfig
from coordinator.metrics import CoordinatorMetrics
from coordinator.service import Coordinator
from site_agent.agent import SiteAgent
from site_agent.config import SiteConfig
from site_agent.metrics import SiteMetrics
from tests.site_agent.test_faults import FakeTrainer
from tests.support.deploy import PROMETHEUS, free_port, http_get, needs_prometheus, wait_prometheus

USER = "prometheus"
PASSWORD = "correct horse battery staple"
WAIT_S = 30.0  # upper bound on waiting for a server thread to count; never a speed check


# --------------------------------------------------------------------------------------------
# A throwaway CA and a server certificate for 127.0.0.1


@dataclass
class Pki:
    ca_file: Path
    cert_file: Path
    key_file: Path
    password_file: Path
    wrong_password_file: Path

    def security(self, **overrides: Any) -> HttpSecurityConfig:
        fields = {
            "tls_cert_file": str(self.cert_file),
            "tls_key_file": str(self.key_file),
            "basic_auth_user": USER,
            "basic_auth_password_file": str(self.password_file),
            **overrides,
        }
        return HttpSecurityConfig(**fields)

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    tmp = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "crossdc test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.OID_SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(
        ca_file=tmp / "ca.pem",
        cert_file=tmp / "server.pem",
        key_file=tmp / "server.key",
        password_file=tmp / "password",
        wrong_password_file=tmp / "wrong-password",
    )
    pki.ca_file.write_bytes(_pem(ca))
    pki.cert_file.write_bytes(_pem(cert))
    pki.key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pki.password_file.write_text(PASSWORD + "\n")  # a trailing newline, as editors leave one
    pki.wrong_password_file.write_text("not the password\n")
    for path in (pki.key_file, pki.password_file, pki.wrong_password_file):
        path.chmod(0o600)
    return pki


# --------------------------------------------------------------------------------------------
# Config


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tls_cert_file": "c.pem"}, "http.tls_key_file"),
        ({"tls_key_file": "k.pem"}, "http.tls_cert_file"),
        ({"basic_auth_user": "u"}, "http.basic_auth_password_file"),
        ({"basic_auth_password_file": "p"}, "http.basic_auth_user"),
        ({"basic_auth_user": "a:b", "basic_auth_password_file": "p"}, "http.basic_auth_user"),
        ({"handshake_timeout_s": 0.0}, "http.handshake_timeout_s"),
    ],
)
def test_config_pairs_and_values_are_checked(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        HttpSecurityConfig(**fields)


@pytest.mark.timeout(30)
def test_both_roles_read_the_http_table() -> None:
    http = {"tls_cert_file": "/etc/crossdc/tls.pem", "tls_key_file": "/etc/crossdc/tls.key"}
    coord = build(CoordinatorConfig, {"security": {"insecure": True}, "http": http})
    assert coord.http.tls and not coord.http.basic_auth
    site = build(
        SiteConfig,
        {"site_id": "eu", "coordinator": "tcp://c:7710", "security": {"insecure": True}},
    )
    assert site.http == HttpSecurityConfig()  # off by default
    with pytest.raises(ConfigError, match="http.basic_auth_password_file"):
        build(
            SiteConfig,
            {
                "site_id": "eu",
                "coordinator": "tcp://c:7710",
                "security": {"insecure": True},
                "http": {"basic_auth_user": "prometheus"},
            },
        )


def _server(pki: Pki, metrics: CoordinatorMetrics, **overrides: Any) -> ObserveServer:
    return ObserveServer(
        registry=metrics.registry,
        status=lambda: {"ok": True},
        port=0,
        security=pki.security(**overrides),
        on_refused=metrics.refused,
    )


@pytest.mark.timeout(30)
def test_files_that_cannot_be_used_fail_at_construction_naming_the_field(
    pki: Pki, tmp_path: Path
) -> None:
    metrics = CoordinatorMetrics()
    missing = str(tmp_path / "missing")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    for overrides, named in [
        ({"tls_cert_file": missing}, "http.tls_cert_file"),
        ({"tls_key_file": missing}, "http.tls_key_file"),
        ({"tls_cert_file": str(garbage)}, "http.tls_cert_file"),
        ({"tls_key_file": str(pki.ca_file)}, "http.tls_key_file"),  # a certificate, not its key
        ({"basic_auth_password_file": missing}, "http.basic_auth_password_file"),
        ({"basic_auth_password_file": str(empty)}, "http.basic_auth_password_file"),
    ]:
        with pytest.raises(ValueError, match=named):
            _server(pki, metrics, **overrides)


@pytest.mark.timeout(90)
def test_cli_coordinator_with_a_missing_certificate_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-cert.pem"
    config = tmp_path / "c.toml"
    config.write_text(
        f'[coordinator]\nstate_dir = "{tmp_path}/state"\nbind = "tcp://127.0.0.1:0"\n'
        f"metrics_port = {free_port()}\n"
        f'[coordinator.http]\ntls_cert_file = "{missing}"\ntls_key_file = "{missing}.key"\n'
        "[coordinator.security]\ninsecure = true\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "crossdc", "coordinator", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "http.tls_cert_file" in lines[0] and str(missing) in lines[0]


@pytest.mark.timeout(60)
def test_the_site_agent_reads_its_http_files_when_it_is_built(tmp_path: Path) -> None:
    cfg = SiteConfig(
        site_id="eu",
        coordinator="tcp://127.0.0.1:1",
        state_dir=str(tmp_path / "state"),
        security=SecurityConfig(insecure=True),
        metrics_port=free_port(),
        http=HttpSecurityConfig(
            basic_auth_user=USER, basic_auth_password_file=str(tmp_path / "missing")
        ),
    )
    with pytest.raises(ValueError, match="http.basic_auth_password_file"):
        SiteAgent(cfg, trainer=FakeTrainer())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Certificate expiry in both roles' metrics


@pytest.mark.timeout(60)
def test_both_roles_expose_certificate_expiry(tmp_path: Path) -> None:
    kit = init_kit(tmp_path / "kit")
    eu = issue_site(kit, "eu", 10)
    us_old = issue_site(kit, "us", 5, out_dir=tmp_path / "us-old")
    us_new = issue_site(kit, "us", 90, out_dir=tmp_path / "us-new")
    issue_site(kit, "ap", 30)
    revoke_site(kit, "ap")

    site = SiteAgent(
        SiteConfig(
            site_id="eu",
            coordinator="tcp://127.0.0.1:1",
            state_dir=str(tmp_path / "site-eu"),
            security=SecurityConfig(kit_dir=str(eu.site_kit_dir)),
        ),
        trainer=FakeTrainer(),  # type: ignore[arg-type]
    )
    expiry = site.metrics.registry.get_sample_value(
        "crossdc_site_certificate_expiry_timestamp_seconds", {"site": "eu"}
    )
    assert expiry == eu.certificate.not_after

    coord = Coordinator(
        CoordinatorConfig(
            state_dir=str(tmp_path / "coordinator"),
            bind="tcp://127.0.0.1:0",
            security=SecurityConfig(kit_dir=str(kit)),
        )
    )
    coord.start()
    try:

        def exposed() -> dict[tuple[str, str], float]:
            (family,) = [
                f
                for f in coord.metrics.registry.collect()
                if f.name == "crossdc_certificate_expiry_timestamp_seconds"
            ]
            return {(s.labels["site"], s.labels["serial"]): s.value for s in family.samples}

        # Every certificate it would accept, both of "us" included; none of the revoked "ap".
        assert exposed() == {
            (c.site_id, c.serial): float(c.not_after)
            for c in (eu.certificate, us_old.certificate, us_new.certificate)
        }
        ca = load_ca_certificate(kit / CA_CERT)
        ca_expiry = coord.metrics.registry.get_sample_value(
            "crossdc_ca_certificate_expiry_timestamp_seconds", {"ca": ca.fingerprint}
        )
        assert ca_expiry == ca.not_after > eu.certificate.not_after
        revoke_site(kit, "eu")
        assert coord.registry is not None
        coord.registry.reload()
        assert {site for site, _ in exposed()} == {"us"}
    finally:
        coord.close()


# --------------------------------------------------------------------------------------------
# The server: answers, refusals, counters


def _request(
    server: ObserveServer, pki: Pki, path: str = "/metrics", auth: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"https://127.0.0.1:{server.port}{path}")
    if auth is not None:
        req.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(req, timeout=10, context=pki.client_context()) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _refused(metrics: CoordinatorMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("crossdc_http_refused_total", {"reason": reason})
    return value or 0.0


def _eventually(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {WAIT_S}s waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def served(pki: Pki) -> Iterator[tuple[ObserveServer, CoordinatorMetrics]]:
    metrics = CoordinatorMetrics()
    server = _server(pki, metrics, handshake_timeout_s=1.0)
    server.start()
    try:
        yield server, metrics
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_right_credentials_get_metrics_and_status_over_tls(
    served: tuple[ObserveServer, CoordinatorMetrics], pki: Pki
) -> None:
    server, _ = served
    assert server.scheme == "https"
    code, _, body = _request(server, pki, "/metrics", _basic(USER, PASSWORD))
    assert code == 200
    text = body.decode()
    assert f'crossdc_build_info{{version="{crossdc_version()}"}} 1.0' in text
    assert "process_cpu_seconds_total" in text and "python_info" in text
    code, _, body = _request(server, pki, "/status", _basic(USER, PASSWORD))
    assert code == 200 and json.loads(body) == {"ok": True}
    code, _, _ = _request(server, pki, "/nothing", _basic(USER, PASSWORD))
    assert code == 404


@pytest.mark.timeout(60)
def test_missing_malformed_and_wrong_credentials_get_401_and_are_counted(
    served: tuple[ObserveServer, CoordinatorMetrics], pki: Pki
) -> None:
    server, metrics = served
    cases = [
        (None, "missing_credentials"),
        ("Bearer abc", "malformed_credentials"),
        ("Basic not-base64!", "malformed_credentials"),
        ("Basic " + base64.b64encode(b"no colon").decode(), "malformed_credentials"),
        (_basic(USER, "wrong"), "wrong_credentials"),
        (_basic("someone", PASSWORD), "wrong_credentials"),
        (_basic(USER, PASSWORD + "x"), "wrong_credentials"),
    ]
    for auth, reason in cases:
        before = _refused(metrics, reason)
        for path in ("/metrics", "/status", "/nothing"):  # nothing is answered before auth
            code, headers, body = _request(server, pki, path, auth)
            assert code == 401, (auth, path)
            assert headers.get("WWW-Authenticate", "").startswith('Basic realm="crossdc"')
            assert b"crossdc_" not in body
        assert _refused(metrics, reason) == before + 3, (auth, reason)
    # The server is still serving.
    assert _request(server, pki, "/metrics", _basic(USER, PASSWORD))[0] == 200


@pytest.mark.timeout(60)
def test_plain_http_on_the_tls_port_is_refused_and_counted(
    served: tuple[ObserveServer, CoordinatorMetrics], pki: Pki
) -> None:
    server, metrics = served
    before = _refused(metrics, "tls_handshake")
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read()
    _eventually(lambda: _refused(metrics, "tls_handshake") > before, "the refusal to be counted")
    assert _request(server, pki, "/metrics", _basic(USER, PASSWORD))[0] == 200


@pytest.mark.timeout(60)
def test_a_stalled_handshake_blocks_no_one(pki: Pki) -> None:
    """A client that connects and sends nothing holds up no other client: the handshake is not
    on the accept loop. (Were it, the requests below would wait out their own timeout, which is
    shorter than the server's handshake timeout.)"""
    metrics = CoordinatorMetrics()
    server = _server(pki, metrics, handshake_timeout_s=120.0)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S):
            for _ in range(3):
                assert _request(server, pki, "/metrics", _basic(USER, PASSWORD))[0] == 200
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_stalled_handshake_is_dropped_and_counted(
    served: tuple[ObserveServer, CoordinatorMetrics], pki: Pki
) -> None:
    server, metrics = served  # handshake_timeout_s = 1
    before = _refused(metrics, "tls_handshake")
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as stalled:
        assert stalled.recv(1) == b""  # the server gave up on it and closed the connection
    _eventually(lambda: _refused(metrics, "tls_handshake") > before, "the refusal to be counted")
    assert _request(server, pki, "/metrics", _basic(USER, PASSWORD))[0] == 200


@pytest.mark.timeout(90)
def test_crossdc_status_speaks_tls_and_basic_auth(
    served: tuple[ObserveServer, CoordinatorMetrics], pki: Pki
) -> None:
    server, metrics = served
    url = f"https://127.0.0.1:{server.port}"

    def status(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "crossdc", "status", "--url", url, "--json", *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = status(
        "--ca-file", str(pki.ca_file), "--user", USER, "--password-file", str(pki.password_file)
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"ok": True}
    before = _refused(metrics, "wrong_credentials")
    wrong = status(
        "--ca-file",
        str(pki.ca_file),
        "--user",
        USER,
        "--password-file",
        str(pki.wrong_password_file),
    )
    assert wrong.returncode == 1 and "401" in wrong.stderr, wrong.stderr
    assert _refused(metrics, "wrong_credentials") == before + 1
    untrusted = status("--user", USER, "--password-file", str(pki.password_file))
    assert untrusted.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    half = status("--ca-file", str(pki.ca_file), "--user", USER)
    assert half.returncode == 2 and "--password-file" in half.stderr


@pytest.mark.timeout(60)
def test_a_hook_that_raises_does_not_stop_the_server(pki: Pki) -> None:
    metrics = CoordinatorMetrics()

    def broken(_reason: str) -> None:
        raise RuntimeError("counting failed")

    server = ObserveServer(
        registry=metrics.registry,
        status=dict,
        port=0,
        security=pki.security(),
        on_refused=broken,
    )
    server.start()
    try:
        assert _request(server, pki, "/metrics", _basic(USER, "wrong"))[0] == 401
        assert _request(server, pki, "/metrics", _basic(USER, PASSWORD))[0] == 200
    finally:
        server.close()


# --------------------------------------------------------------------------------------------
# A real Prometheus scraping both roles over HTTPS with basic auth


@dataclass
class SecurePrometheus:
    url: str
    log: Path
    coordinator: CoordinatorMetrics
    site: SiteMetrics

    def api(self, path: str, **params: str) -> Any:
        return http_get(f"{self.url}/api/v1/{path}", **params)

    def query(self, expr: str) -> list[dict[str, Any]]:
        res = self.api("query", query=expr)
        assert res.get("status") == "success", res
        result: list[dict[str, Any]] = res["data"]["result"]
        return result

    def targets(self) -> dict[str, dict[str, Any]]:
        active = self.api("targets")["data"]["activeTargets"]
        return {t["labels"]["job"]: t for t in active}


@pytest.fixture(scope="module")
def secure_prometheus(
    pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SecurePrometheus]:
    """Prometheus scraping a coordinator and a site ObserveServer, both HTTPS with basic auth,
    and the coordinator once more as job "wrong-password" with a wrong password file."""
    assert PROMETHEUS is not None
    tmp = tmp_path_factory.mktemp("secure-prometheus")
    coord, site = CoordinatorMetrics(), SiteMetrics("eu")
    servers = [
        ObserveServer(
            registry=m.registry,
            status=dict,
            port=0,
            security=pki.security(),
            on_refused=m.refused,
        )
        for m in (coord, site)
    ]
    prom: subprocess.Popen[bytes] | None = None
    log = tmp / "prometheus.log"
    try:
        for server in servers:
            server.start()

        def job(name: str, port: int, password_file: Path) -> dict[str, Any]:
            return {
                "job_name": name,
                "scheme": "https",
                "tls_config": {"ca_file": str(pki.ca_file)},
                "basic_auth": {"username": USER, "password_file": str(password_file)},
                "honor_labels": True,
                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
            }

        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                job("crossdc-coordinator", servers[0].port, pki.password_file),
                job("crossdc-site", servers[1].port, pki.password_file),
                job("wrong-password", servers[0].port, pki.wrong_password_file),
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
        live = SecurePrometheus(f"http://127.0.0.1:{port}", log, coord, site)

        def every_target_scraped() -> bool:
            targets = live.targets()
            return len(targets) == 3 and all(t["health"] != "unknown" for t in targets.values())

        wait_prometheus(every_target_scraped, "a scrape of every target", prom, log)
        yield live
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(timeout=15)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
        for server in servers:
            server.close()


def _poll(live: SecurePrometheus, predicate: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{live.log.read_text()}"
        time.sleep(0.25)


@needs_prometheus
@pytest.mark.timeout(120)
def test_prometheus_scrapes_both_roles_over_tls_with_basic_auth(
    secure_prometheus: SecurePrometheus,
) -> None:
    live = secure_prometheus
    for job in ("crossdc-coordinator", "crossdc-site"):
        up = _poll(live, lambda j=job: live.query(f'up{{job="{j}"}} == 1'), f"{job} up")
        assert len(up) == 1, up
        info = _poll(
            live, lambda j=job: live.query(f'crossdc_build_info{{job="{j}"}}'), "build info"
        )
        assert info[0]["metric"]["version"] == crossdc_version()
        assert float(info[0]["value"][1]) == 1.0
    assert live.query('python_info{job="crossdc-site"}')
    assert live.targets()["crossdc-coordinator"]["scrapeUrl"].startswith("https://")


@needs_prometheus
@pytest.mark.timeout(120)
def test_a_target_with_a_wrong_password_is_down_and_counted(
    secure_prometheus: SecurePrometheus,
) -> None:
    live = secure_prometheus
    _poll(live, lambda: live.query('up{job="wrong-password"} == 0'), "wrong-password down")
    target = live.targets()["wrong-password"]
    assert target["health"] == "down" and "401" in target["lastError"], target
    # The coordinator counted the refusals, and Prometheus scraped that count from it.
    _poll(
        live,
        lambda: live.query(
            'crossdc_http_refused_total{job="crossdc-coordinator", reason="wrong_credentials"} > 0'
        ),
        "the refusals in the coordinator's own metrics",
    )
    assert not live.query('up{job=~"crossdc-.*"} == 0')
