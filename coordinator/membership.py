"""Membership: who is in the federation, as plain data and pure decisions.

The service loop records joins, heartbeats and leaves into a :class:`Member` table; the
decisions here (who timed out, who is in sync) take ``now`` and the table and return a result
with a reason, so they are tested without sockets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Member:
    """One joined site as the coordinator sees it."""

    site_id: str
    peer: bytes
    joined_at: float
    last_seen: float
    global_version: int
    """The global version the site holds (after its last applied Global)."""
    in_sync: bool
    """True when the site holds exactly the coordinator's current global parameters."""
    evaluates: bool = True
    """The site can validate a global model (a training loop wrapped without ``evaluate``
    cannot: it says so at its join, ``capabilities["evaluates"]``)."""


def touch(member: Member, now: float, peer: bytes) -> Member:
    """A message arrived from the member: it is alive, and reachable at ``peer``."""
    return replace(member, last_seen=now, peer=peer)


def expired(now: float, members: Mapping[str, Member], timeout_s: float) -> tuple[list[str], str]:
    """Sites silent for longer than ``timeout_s``, sorted, and why."""
    gone = sorted(s for s, m in members.items() if now - m.last_seen > timeout_s)
    if not gone:
        return [], "all members alive"
    ages = ", ".join(f"{s}={now - members[s].last_seen:.1f}s" for s in gone)
    return gone, f"silent longer than {timeout_s:.1f}s: {ages}"


def ready_sites(members: Mapping[str, Member], global_version: int) -> list[str]:
    """Sites that can take part in the next round: in sync with the current global version."""
    return sorted(s for s, m in members.items() if m.in_sync and m.global_version == global_version)
