"""The HTTP face of a role: Prometheus ``/metrics`` and a JSON ``/status``, on one port.

Runs ``http.server`` on a daemon thread; ``status`` is a callable returning a JSON-able dict,
called on the HTTP thread, so it must only read state the role publishes for it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class ObserveServer:
    """Serves ``/metrics`` from ``registry`` and ``/status`` from ``status()``."""

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        status: Callable[[], dict[str, Any]],
        host: str = "127.0.0.1",
        port: int,
    ) -> None:
        self.registry = registry
        self.status = status
        self.host = host
        self.requested_port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "ObserveServer not started"
        return int(self._server.server_address[1])

    def start(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype = generate_latest(owner.registry), CONTENT_TYPE_LATEST
                elif path == "/status":
                    body = json.dumps(owner.status(), sort_keys=True).encode()
                    ctype = "application/json"
                else:
                    self.send_error(404, "try /metrics or /status")
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: " + format, *args)

        self._server = ThreadingHTTPServer((self.host, self.requested_port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="observe-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
