"""The global model to one site outside a broadcast: after a join, a SyncRequest or a result
that failed to reach it. The broadcast deltas since the version the site holds when the delta
log proves its hash and bridges the gap, else the whole model; either once the state it shows is
durable."""

from __future__ import annotations

import logging

from coordinator.global_model import GlobalModel
from coordinator.membership import Membership
from coordinator.metrics import CoordinatorMetrics
from coordinator.post import PostOffice
from coordinator.state import GlobalState

log = logging.getLogger("crossdc.coordinator")


class Delivery:
    """Brings one site to the current model; what it holds is told to the membership."""

    def __init__(
        self,
        members: Membership,
        model: GlobalModel,
        post: PostOffice,
        metrics: CoordinatorMetrics,
    ) -> None:
        self._members = members
        self._model = model
        self._post = post
        self._metrics = metrics

    def send_full(self, site_id: str) -> None:
        """The whole current model (sent once the latest save, which covers it, is durable)."""
        state = self._model.state
        assert state is not None
        self._post.later(lambda: self._full_now(site_id, state))

    def send_catch_up(self, site_id: str, version: int, digest: str) -> None:
        """Bring a site that holds ``version`` (state hash ``digest``) to the current model:
        the broadcast deltas since (read back from the delta log's files when it has a
        directory), when the log proves its hash and bridges the gap, else the model."""
        state = self._model.state
        assert state is not None
        self._post.later(lambda: self._catch_up_now(site_id, version, digest, state))

    def _catch_up_now(self, site_id: str, version: int, digest: str, state: GlobalState) -> None:
        m = self._members.get(site_id)
        if m is None or m.in_sync:
            return  # left, or a broadcast in between brought it up to date
        chain = self._model.deltas.chain(version, digest, state.global_version)
        if chain is None:
            self._full_now(site_id, state)
            return
        if all(self._post.send_now(m.peer, msg) for msg in chain):
            self._members.holds(site_id, state.global_version, in_sync=True)
            self._metrics.catch_up_deltas.inc(len(chain))
            log.info(
                "[coordinator site=%s] caught up v%d -> v%d with %d deltas (%d bytes)",
                site_id,
                version,
                state.global_version,
                len(chain),
                sum(enc.nbytes for msg in chain for enc in msg.payload),
            )

    def _full_now(self, site_id: str, state: GlobalState) -> None:
        m = self._members.get(site_id)
        if m is None:
            return  # left while its model waited for a save
        version = state.global_version
        if self._post.send_now(m.peer, self._model.full_global(state, round_id=version)):
            self._members.holds(site_id, version, in_sync=True)
            log.info("[coordinator site=%s] sent full model v%d", site_id, version)
