"""A role's published status (``StatusBoard``, mirrored to ``status.json``) and the
``endpoint.json`` a local coordinator writes for launchers and sites."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from comm.durable import atomic_write

STATUS_HISTORY_TAIL = 20
"""Rounds a ``StatusBoard`` keeps in its status (the rest: ``read_history``)."""


def write_endpoint(state_dir: Path, endpoint: str, session_id: str) -> None:
    """``endpoint.json``: where a local coordinator listens, for launchers and sites to read."""
    state_dir.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"endpoint": endpoint, "session_id": session_id}).encode()
    atomic_write(state_dir / "endpoint.json", body)


class StatusBoard:
    """A role's latest status: read from other threads (HTTP /status), mirrored to a file.

    ``publish`` replaces the status and, with a path, writes it atomically as JSON, so a local
    launcher can follow a role without a port. A status's ``history`` list is cut to its last
    ``history_tail`` entries, with ``history_count`` its full length (the coordinator's full
    history is in its state directory: ``read_history``); with ``val_losses_tail``, the
    ``val_losses`` mapping (keyed by version or step) keeps its highest keys and gains
    ``val_losses_count``. A caller may pass only the last entries with the counts itself (the
    counts given are kept). So what is published and written stays the same size however long
    the run.
    """

    def __init__(
        self,
        path: Path | None,
        clock: Callable[[], float],
        *,
        history_tail: int | None = STATUS_HISTORY_TAIL,
        val_losses_tail: int | None = None,
    ) -> None:
        self.path = path
        self.clock = clock
        self.history_tail = history_tail
        self.val_losses_tail = val_losses_tail
        self.published_at = float("-inf")
        self._lock = threading.Lock()
        self._status: dict[str, Any] = {}

    def _bounded(self, status: dict[str, Any]) -> dict[str, Any]:
        history = status.get("history")
        if self.history_tail is not None and isinstance(history, list):
            tail = history[max(0, len(history) - self.history_tail) :]
            # A caller that passes only the last rounds says how many there are in all.
            count = status.get("history_count", len(history))
            status = {**status, "history": tail, "history_count": count}
        vals = status.get("val_losses")
        if self.val_losses_tail is not None and isinstance(vals, dict):
            keys = sorted(vals, key=int)
            kept = keys[max(0, len(keys) - self.val_losses_tail) :]
            metrics = status.get("val_metrics")
            status = {
                **status,
                "val_losses": {k: vals[k] for k in kept},
                "val_losses_count": status.get("val_losses_count", len(vals)),
            }
            if isinstance(metrics, dict):  # the other metrics of the same versions
                status["val_metrics"] = {k: metrics[k] for k in kept if k in metrics}
        return status

    def publish(self, status: dict[str, Any]) -> None:
        status = self._bounded(status)
        with self._lock:
            self._status = status
        self.published_at = self.clock()
        if self.path is not None:
            body = json.dumps(status, indent=1, sort_keys=True).encode()
            atomic_write(self.path, body)

    def get(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._status)
