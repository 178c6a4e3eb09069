"""Membership: who is in the federation, what each member holds, and who fell silent.

:class:`Membership` is the table of :class:`Member` records: the intake records joins, messages
heard (``touch``) and leaves; the delivery and the broadcast record what each member holds after
a model was (or failed to be) sent to it (``holds``); the lifecycle reads who is ready for a
round and removes the members silent for longer than the site timeout (``expire``). It holds no
socket and reads no clock (``now`` is an argument). The decisions under it (who timed out, who
is in sync) are pure functions of ``now`` and the table, each with a reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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


class Membership(Mapping[str, Member]):
    """The federation's members by site id (a read-only mapping; changed by its verbs only)."""

    def __init__(self, site_timeout_s: float) -> None:
        self.site_timeout_s = site_timeout_s
        """A member not heard from for this long is removed (``expire``)."""
        self._members: dict[str, Member] = {}

    def __getitem__(self, site_id: str) -> Member:
        return self._members[site_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    # ---- events --------------------------------------------------------------------------------

    def join(
        self,
        now: float,
        site_id: str,
        peer: bytes,
        *,
        in_sync_version: int | None,
        evaluates: bool = True,
    ) -> None:
        """A site joined (or rejoined) on ``peer``; ``in_sync_version`` is the version it holds
        when that is exactly the coordinator's, else None."""
        self._members[site_id] = Member(
            site_id=site_id,
            peer=peer,
            joined_at=now,
            last_seen=now,
            global_version=-1 if in_sync_version is None else in_sync_version,
            in_sync=in_sync_version is not None,
            evaluates=evaluates,
        )

    def touch(self, now: float, site_id: str, peer: bytes) -> Member | None:
        """A message from ``peer`` naming ``site_id``: the member, refreshed (None if unknown,
        or if ``peer`` is not its connection)."""
        m = self._members.get(site_id)
        if m is None or m.peer != peer:
            return None
        self._members[site_id] = touch(m, now, peer)
        return self._members[site_id]

    def holds(self, site_id: str, version: int, *, in_sync: bool) -> None:
        """What a member holds after a Global was (or failed to be) sent to it."""
        m = self._members.get(site_id)
        if m is not None:
            self._members[site_id] = replace(m, global_version=version, in_sync=in_sync)

    def leave(self, site_id: str) -> Member | None:
        """A member that left (None: it was not one)."""
        return self._members.pop(site_id, None)

    def expire(self, now: float) -> tuple[tuple[Member, ...], str]:
        """Remove the members silent for longer than the site timeout: them (sorted), and why."""
        gone, why = expired(now, self._members, self.site_timeout_s)
        return tuple(self._members.pop(s) for s in gone), why

    # ---- views ---------------------------------------------------------------------------------

    def ready(self, global_version: int, unconfirmed: frozenset[str] = frozenset()) -> list[str]:
        """Members that can take part in the next round: in sync with ``global_version`` and
        not awaiting the acknowledgement of a model sent to them (``unconfirmed``)."""
        return [s for s in ready_sites(self._members, global_version) if s not in unconfirmed]

    def in_sync(self, version: int) -> list[str]:
        """Members holding exactly ``version``, sorted."""
        return ready_sites(self._members, version)

    def holder(self, peer: bytes) -> bool:
        """Whether ``peer`` is a member's connection."""
        return any(m.peer == peer for m in self._members.values())
