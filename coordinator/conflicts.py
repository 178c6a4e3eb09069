"""Identity conflicts: a second connection claiming a site whose current connection is alive.

A site's certificate authenticates whoever holds the site's key, so a site restarted on a new
connection and a thief with a copy of the key look alike at the handshake. What tells them
apart is the connection the coordinator already serves for that site: a restarted site's has
gone (closed, or silent for the heartbeat timeout), a copied key's victim keeps heartbeating.

The intake judges each join of a member's site id from another connection (:func:`judge_claim`):
a current connection silent for ``heartbeat_timeout_s`` is replaced, as any rejoin; a live one is
kept and the newcomer refused, its claim recorded here. When the current connection is heard
from again while a claim stands, both are alive at once: :class:`IdentityConflicts` counts the
conflict in ``crossdc_identity_conflicts_total{site}`` and logs both peers. Counting only then
keeps a restart whose old connection was merely not yet given up from raising the alarm.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.membership import Member
from coordinator.metrics import CoordinatorMetrics

log = logging.getLogger("crossdc.coordinator")

REVOKE_COMMAND = "crossdc keys revoke --kit KIT --site {site}"
"""What the operator runs when the site did not restart: its key is in other hands."""


class ClaimVerdict(enum.Enum):
    """What a join of ``site_id`` from ``peer`` means for the member of that id."""

    NEW = "no member holds the site id"
    SAME = "a join again on the member's own connection"
    REPLACES = "the member's connection is silent: the site restarted or reconnected anew"
    CONTESTED = "the member's connection is alive"


def judge_claim(
    now: float, member: Member | None, peer: bytes, heartbeat_timeout_s: float
) -> tuple[ClaimVerdict, str]:
    """The verdict on a join from ``peer`` for ``member``'s site id, and why."""
    if member is None:
        return ClaimVerdict.NEW, "not a member"
    if member.peer == peer:
        return ClaimVerdict.SAME, "its own connection"
    silent_s = now - member.last_seen
    if silent_s >= heartbeat_timeout_s:
        why = f"its connection was silent {silent_s:.1f}s (timeout {heartbeat_timeout_s:.1f}s)"
        return ClaimVerdict.REPLACES, why
    why = (
        f"its connection was heard from {silent_s:.1f}s ago; another connection is admitted "
        f"once that one is closed or silent for {heartbeat_timeout_s:.1f}s"
    )
    return ClaimVerdict.CONTESTED, why


@dataclass(frozen=True)
class Claim:
    """A refused join: the connection that made it, and when."""

    peer: bytes
    at: float


class IdentityConflicts:
    """Claims on live members' site ids; ``forget`` drops a site's (every removal path)."""

    def __init__(
        self,
        *,
        heartbeat_timeout_s: float,
        metrics: CoordinatorMetrics,
        describe: Callable[[bytes], str],
    ) -> None:
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._metrics = metrics
        self._describe = describe
        self.claims: dict[str, Claim] = {}
        """Per site id, the latest refused claim not yet confirmed as a conflict."""

    def judge(self, now: float, member: Member | None, peer: bytes) -> tuple[ClaimVerdict, str]:
        return judge_claim(now, member, peer, self._heartbeat_timeout_s)

    def watch(self, site_id: str) -> None:
        """A member joined: its counter exists (at 0) from now, so a first conflict is an
        increase that Prometheus sees."""
        self._metrics.identity_conflicts.labels(site=site_id)

    def claimed(self, now: float, site_id: str, peer: bytes) -> None:
        """``peer``'s join of ``site_id`` was refused: the member's connection was alive."""
        self.claims[site_id] = Claim(peer, now)

    def heard_from(self, member: Member) -> bool:
        """``member``'s current connection sent a message: a claim standing on its site id
        becomes a conflict (counted and logged once). True when one did."""
        claim = self.claims.pop(member.site_id, None)
        if claim is None or claim.peer == member.peer:
            return False
        site_id = member.site_id
        self._metrics.identity_conflicts.labels(site=site_id).inc()
        log.warning(
            "[coordinator site=%s] identity conflict: %s claimed the site while its current "
            "connection %s still heartbeats; serving the current one. Two processes hold the "
            "key of site %s: unless its agent was started twice, the key is stolen: revoke "
            "the site's certificate (%s) and issue it a new kit",
            site_id,
            self._describe(claim.peer),
            self._describe(member.peer),
            site_id,
            REVOKE_COMMAND.format(site=site_id),
        )
        return True

    def forget(self, site_id: str) -> None:
        """The site joined anew, left or was removed: its claims are settled."""
        self.claims.pop(site_id, None)
