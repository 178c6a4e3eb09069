"""The HTTP face of a role: Prometheus ``/metrics`` and a JSON ``/status``, on one port.

Runs ``http.server`` on a daemon thread; ``status`` is a callable returning a JSON-able dict,
called on the HTTP thread, so it must only read state the role publishes for it.

With an :class:`~comm.ops.httpsec.HttpSecurityConfig` the port speaks HTTPS and/or asks for
HTTP basic auth. The accept loop only accepts: each connection's TLS handshake runs on that
connection's own thread, bounded by ``handshake_timeout_s``, so a client that stalls holds up no
one else. A refused request (a failed handshake, missing or wrong credentials) answers 401 or
closes the connection, and is reported to ``on_refused`` with its reason.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from comm.ops.httpsec import REFUSED_TLS, HttpSecurity, HttpSecurityConfig, load_http_security

log = logging.getLogger(__name__)

REALM = "crossdc"


def crossdc_version() -> str:
    """The installed crossdc distribution's version (``unknown`` in a tree never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("crossdc")
    except PackageNotFoundError:
        return "unknown"


def register_process_collectors(registry: CollectorRegistry) -> None:
    """The process's own figures on ``registry``: ``process_*`` (CPU seconds, resident and
    virtual memory, open file descriptors, start time; Linux) and ``python_info``."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)


class _Server(ThreadingHTTPServer):
    """A threading HTTP server whose TLS handshakes run on the per-connection threads."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        security: HttpSecurity,
        refused: Callable[[str], None],
    ) -> None:
        super().__init__(address, handler)
        self.security = security
        self.refused = refused
        if security.ssl_context is not None:
            # accept() wraps each connection without a handshake; finish_request does it.
            self.socket = security.ssl_context.wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Runs on the connection's own thread (ThreadingMixIn.process_request_thread).
        if isinstance(request, ssl.SSLSocket):
            request.settimeout(self.security.handshake_timeout_s)
            try:
                request.do_handshake()
            except (OSError, ValueError) as exc:  # ssl.SSLError, timeouts and resets
                log.debug("http: TLS handshake with %s failed: %s", client_address, exc)
                self.refused(REFUSED_TLS)
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away mid-request is not worth a traceback on stderr.
        log.debug("http: error serving %s", client_address, exc_info=True)


class ObserveServer:
    """Serves ``/metrics`` from ``registry`` and ``/status`` from ``status()``.

    ``security`` (TLS, basic auth) is loaded here, so a certificate, key or password file that
    cannot be used raises :class:`ValueError` (naming the field) before anything listens.
    ``on_refused(reason)`` counts each refused request (``comm.ops.httpsec.REFUSED_*``).
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        status: Callable[[], dict[str, Any]],
        host: str = "127.0.0.1",
        port: int,
        security: HttpSecurityConfig | None = None,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.registry = registry
        self.status = status
        self.host = host
        self.requested_port = port
        self.security = load_http_security(security or HttpSecurityConfig())
        self._on_refused = on_refused
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "ObserveServer not started"
        return int(self._server.server_address[1])

    @property
    def scheme(self) -> str:
        return "https" if self.security.ssl_context is not None else "http"

    def _refused(self, reason: str) -> None:
        if self._on_refused is not None:
            try:
                self._on_refused(reason)
            except Exception:  # a counting hook must never take the server down
                log.exception("http: on_refused hook failed")

    def start(self) -> None:
        owner = self
        security = self.security

        class Handler(BaseHTTPRequestHandler):
            timeout = security.handshake_timeout_s  # a request line and headers, at most
            server_version = "crossdc"
            sys_version = ""

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                refusal = security.check_authorization(self.headers.get("Authorization"))
                if refusal is not None:
                    owner._refused(refusal)
                    self._answer(
                        401,
                        b"authentication required\n",
                        "text/plain; charset=utf-8",
                        {"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'},
                    )
                    return
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype = generate_latest(owner.registry), CONTENT_TYPE_LATEST
                elif path == "/status":
                    body = json.dumps(owner.status(), sort_keys=True).encode()
                    ctype = "application/json"
                else:
                    self.send_error(404, "try /metrics or /status")
                    return
                self._answer(200, body, ctype, {})

            def _answer(self, code: int, body: bytes, ctype: str, headers: dict[str, str]) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: " + format, *args)

        self._server = _Server((self.host, self.requested_port), Handler, security, self._refused)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="observe-http", daemon=True
        )
        self._thread.start()
        log.info(
            "serving /metrics and /status on %s://%s:%d%s",
            self.scheme,
            self.host,
            self.port,
            " (basic auth)" if security.basic_auth else "",
        )

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
