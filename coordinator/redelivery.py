"""Redelivery: what a lost connection may have dropped on its way to a site, sent again once the
site is heard from.

A connection given up (a silence as long as the heartbeat timeout) or reset (a send to the site
failed: it was not connected) loses what was in flight. Two losses would hold a round until its
deadline: a RoundStart (the site never hears of the round, so never sends its update) and a
result (with overlap the site sends nothing more on top of an unmerged fragment, and a site the
coordinator no longer counts in sync is left out of the next plans, so no plan tells it that it
is behind). When the site's next message arrives, the open rounds that wait on its update send
it their plan again, and a site that missed a result gets the broadcast deltas since the version
it holds (or the model). A copy that did arrive is dropped by the site: a plan delivered twice,
or a delta from a version it no longer holds (then it asks for the model).
"""

from __future__ import annotations

import logging

from coordinator.delivery import Delivery
from coordinator.global_model import GlobalModel
from coordinator.ledger import RoundLedger
from coordinator.lifecycle import Lifecycle
from coordinator.membership import Member
from coordinator.metrics import CoordinatorMetrics
from coordinator.post import PostOffice

log = logging.getLogger("crossdc.coordinator")


class Redelivery:
    """Which members are owed what; ``forget`` drops a member's records (every removal path)."""

    def __init__(
        self,
        *,
        heartbeat_timeout_s: float,
        book: Lifecycle,
        ledger: RoundLedger,
        model: GlobalModel,
        delivery: Delivery,
        post: PostOffice,
        metrics: CoordinatorMetrics,
    ) -> None:
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._book = book
        self._ledger = ledger
        self._model = model
        self._delivery = delivery
        self._post = post
        self._metrics = metrics
        self.undelivered: set[str] = set()
        """Members a send failed to since they were last heard from."""
        self.missed_result: set[str] = set()
        """Members a broadcast failed to reach."""

    def send_failed(self, peer: bytes) -> None:
        """A send to ``peer`` failed (not connected): if it is a member's, that member is owed."""
        for site_id, m in self._book.members.items():
            if m.peer == peer:
                self.undelivered.add(site_id)
                return

    def missed(self, site_id: str) -> None:
        """A round's result failed to reach ``site_id``."""
        self.missed_result.add(site_id)

    def forget(self, site_id: str) -> None:
        """A member joined afresh (answered with what it needs), left or was removed."""
        self.undelivered.discard(site_id)
        self.missed_result.discard(site_id)

    def heard_from(self, member: Member, silent_s: float) -> None:
        """``member`` sent a message after ``silent_s`` of silence: send again what it may have
        lost, if its connection was given up or a send to it failed since it was last heard."""
        site_id = member.site_id
        failed = site_id in self.undelivered
        if not failed and silent_s < self._heartbeat_timeout_s:
            return  # the connection held: nothing was lost
        self.undelivered.discard(site_id)
        why = "a send to it failed" if failed else f"{silent_s:.1f}s of silence"
        for round_id in self._book.awaiting(site_id):
            plan = self._ledger.start_for(round_id, site_id)
            if plan is None:
                continue
            log.warning(
                "[coordinator round=%d site=%s] heard from again after %s: sending its plan again",
                round_id,
                site_id,
                why,
            )
            self._metrics.plans_resent.inc()
            self._post.send(member.peer, plan)
        # Only a broadcast that failed to reach it: a site out of sync for another reason (the
        # initial model not there yet, a SyncRequest answered) is already being served.
        if site_id in self.missed_result and not member.in_sync and self._model.state is not None:
            self.missed_result.discard(site_id)
            version = member.global_version
            log.warning(
                "[coordinator site=%s] heard from again after %s: it holds v%d, sending what it "
                "missed",
                site_id,
                why,
                version,
            )
            self._delivery.send_catch_up(site_id, version, self._model.deltas.hash_at(version))
