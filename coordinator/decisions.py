"""What the round lifecycle decides, and its verdicts on updates: plain frozen data.

:class:`~coordinator.lifecycle.Lifecycle` returns these; the service carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from comm.wire.schema import ErrorCode
from coordinator.membership import Member
from coordinator.rounds import OpenRound


@dataclass(frozen=True)
class ClosedRound:
    """What is remembered of a closed (or aborted) round, to judge its late updates."""

    participants: frozenset[str]
    merged: frozenset[str]
    fragment: int


@dataclass(frozen=True)
class LateUpdate:
    """An update accepted after its round closed, waiting for its fragment's next sync."""

    site_id: str
    round_id: int
    fragment: int


@dataclass(frozen=True)
class Open:
    round_id: int
    participants: tuple[str, ...]
    fragment: int
    base_version: int
    """The global version of the fragment the updates must build on (maybe still in flight)."""
    why: str


@dataclass(frozen=True)
class Close:
    round: OpenRound
    merged: tuple[str, ...]
    late: tuple[LateUpdate, ...]
    """Late updates of earlier rounds of the same fragment, merged here (once)."""
    final: bool
    """The run's last round (``max_rounds`` reached by this close)."""
    why: str


@dataclass(frozen=True)
class Abort:
    round_ids: tuple[int, ...]
    """Every open round: later ones build on the oldest, which cannot complete."""
    why: str


@dataclass(frozen=True)
class Rerun:
    """Secure aggregation: the oldest round lacks some masked vectors; the service either re-runs
    it with the survivors (``Lifecycle.rerun``) or abandons it (``Lifecycle.abort``)."""

    round: OpenRound
    received: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Finish:
    why: str


@dataclass(frozen=True)
class Remove:
    """Silent members, removed (the service forgets their connections)."""

    members: tuple[Member, ...]
    why: str

    @property
    def site_ids(self) -> tuple[str, ...]:
        return tuple(m.site_id for m in self.members)


Decision = Open | Close | Abort | Rerun | Finish | Remove


@dataclass(frozen=True)
class UpdateRefusal:
    """An update that may not be accepted: the Error code and detail its sender is told."""

    code: ErrorCode
    detail: str


@dataclass(frozen=True)
class Admission:
    """An update that may be accepted: on time (its round is open) or late."""

    late: bool
    fragment: int
