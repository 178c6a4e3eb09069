"""The coordinator's published status: what ``/status``, ``status.json`` and ``crossdc status``
show, built from the components that own each part and published only for durable states."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.global_model import GlobalModel
from coordinator.lifecycle import Lifecycle
from coordinator.membership import Membership
from coordinator.metrics import CoordinatorMetrics
from coordinator.post import PostOffice
from coordinator.status_board import STATUS_HISTORY_TAIL, StatusBoard


class CoordinatorStatus:
    """``publish`` the current status (skipped while a save is in flight); ``get`` it."""

    def __init__(
        self,
        *,
        session_id: str,
        state_dir: Path | None,
        clock: Callable[[], float],
        members: Membership,
        book: Lifecycle,
        model: GlobalModel,
        post: PostOffice,
        metrics: CoordinatorMetrics,
    ) -> None:
        self.session_id = session_id
        self.endpoint = ""
        self._members = members
        self._book = book
        self._model = model
        self._post = post
        self._metrics = metrics
        self._board = StatusBoard(state_dir / "status.json" if state_dir else None, clock)
        self.shard: tuple[int, int] | None = None
        """A shard of several: (its index, the shard count); the status then says both and
        the shard's own hash (``shard_hash``) beside the whole model's (``state_hash``)."""

    @property
    def published_at(self) -> float:
        return self._board.published_at

    def publish(self, *, finished: bool) -> None:
        self._post.observe_transfers()
        if not self._post.durable:
            return  # the status shows durable states only; the next tick publishes this one
        st, chan, book = self._model.state, self._post.chan, self._book
        status: dict[str, Any] = {
            "session_id": self.session_id,
            "endpoint": self.endpoint,
            "finished": finished,
            "global_version": st.global_version if st else None,
            "state_hash": self._model.site_hash() if st else None,
            "round_counter": st.round_counter if st else 0,
            "rounds_completed": len(st.history) if st else 0,
            "members": sorted(self._members),
            "open_round": book.open_rounds[0].round_id if book.open_rounds else None,
            "open_rounds": [r.round_id for r in book.open_rounds],
            "val_losses": {str(k): v for k, v in sorted(st.val_losses.items())} if st else {},
            "val_metrics": {str(k): v for k, v in sorted(st.val_metrics.items())} if st else {},
            "history": list(st.history[-STATUS_HISTORY_TAIL:]) if st else [],
            "history_count": len(st.history) if st else 0,
            "wire_bytes_in": chan.stats.bytes_received if chan else 0,
            "wire_bytes_out": chan.stats.bytes_sent if chan else 0,
            "rejected": dict(chan.stats.rejected) if chan else {},
            "transfers_waited": chan.stats.transfers_waited if chan else 0,
            "reassembly_peak_bytes": chan.stats.reassembly_peak_bytes if chan else 0,
            "num_parameters": int(sum(v.size for v in st.params.values())) if st else 0,
            # The fold's speed: values folded and the CPU seconds of the thread that folded them.
            "fold_parameter_updates": int(self._sample("crossdc_fold_parameter_updates_total")),
            "fold_cpu_seconds": self._sample("crossdc_fold_cpu_seconds_total"),
        }
        if self.shard is not None:
            status["shard"], status["shards"] = self.shard
            status["shard_hash"] = self._model.hash() if st else None
        self._board.publish(status)

    def _sample(self, name: str) -> float:
        return self._metrics.registry.get_sample_value(name) or 0.0

    def get(self) -> dict[str, Any]:
        """The latest published status (safe to call from another thread)."""
        return self._board.get()
