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
from typing import TYPE_CHECKING

from coordinator import delivery
from coordinator.membership import Member

if TYPE_CHECKING:
    from coordinator.service import Coordinator

log = logging.getLogger("crossdc.coordinator")


def send_failed(c: Coordinator, peer: bytes) -> None:
    """A send to ``peer`` failed (not connected): if it is a member's, that member is owed."""
    for site_id, m in c.book.members.items():
        if m.peer == peer:
            c._undelivered.add(site_id)
            return


def heard_from(c: Coordinator, member: Member, silent_s: float) -> None:
    """``member`` sent a message after ``silent_s`` of silence: send again what it may have
    lost, if its connection was given up or a send to it failed since it was last heard."""
    site_id = member.site_id
    failed = site_id in c._undelivered
    if not failed and silent_s < c.cfg.channel.heartbeat_timeout_s:
        return  # the connection held: nothing was lost
    c._undelivered.discard(site_id)
    why = "a send to it failed" if failed else f"{silent_s:.1f}s of silence"
    for round_id in c.book.awaiting(site_id):
        plan = c._round_starts.get(round_id, {}).get(site_id)
        if plan is None:
            continue
        log.warning(
            "[coordinator round=%d site=%s] heard from again after %s: sending its plan again",
            round_id,
            site_id,
            why,
        )
        c.metrics.plans_resent.inc()
        c._send(member.peer, plan)
    # Only a broadcast that failed to reach it: a site out of sync for another reason (the
    # initial model not there yet, a SyncRequest answered) is already being served.
    if site_id in c._missed_result and not member.in_sync and c.state is not None:
        c._missed_result.discard(site_id)
        version = member.global_version
        log.warning(
            "[coordinator site=%s] heard from again after %s: it holds v%d, sending what it missed",
            site_id,
            why,
            version,
        )
        delivery.send_catch_up(c, site_id, version, c.deltas.hash_at(version))
