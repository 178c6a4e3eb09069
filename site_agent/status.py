"""The site's status document: what ``/status`` serves and ``status.json`` holds, one section
per component, merged in the order given; and the HTTP server of ``/status`` and ``/metrics``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from comm.durable import atomic_write
from comm.ops.observe import ObserveServer
from site_agent.config import SiteConfig
from site_agent.metrics import SiteMetrics

Section = Callable[[], Mapping[str, Any]]


class SiteStatus:
    """Reads each component's section on demand; ``write`` leaves the document in the site's
    state directory (a reader there sees the last one whole)."""

    def __init__(self, *, site_id: str, path: Path, sections: Sequence[Section]) -> None:
        self.site_id = site_id
        self.path = path
        self._sections = tuple(sections)

    def snapshot(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"site_id": self.site_id}
        for section in self._sections:
            doc.update(section())
        return doc

    def write(self) -> None:
        body = json.dumps(self.snapshot(), sort_keys=True).encode()
        atomic_write(self.path, body, mode=0o644)


def status_server(
    cfg: SiteConfig, metrics: SiteMetrics, status: SiteStatus
) -> ObserveServer | None:
    """The HTTP server of ``/metrics`` and ``/status`` when ``site.metrics_port`` asks for one;
    built (its TLS and password files read) with the agent, so a bad file fails before the
    start."""
    if not cfg.metrics_port:
        return None
    return ObserveServer(
        registry=metrics.registry,
        status=status.snapshot,
        host=cfg.metrics_host,
        port=cfg.metrics_port,
        security=cfg.http,
        on_refused=metrics.refused,
    )
