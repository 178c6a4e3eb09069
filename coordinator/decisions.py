"""What the round lifecycle decides: plain frozen data naming the rounds it is about.

:class:`~coordinator.lifecycle.Lifecycle` returns these, its transition applied; the service
carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.membership import Member
from coordinator.round import Round


@dataclass(frozen=True)
class Open:
    round: Round
    """The new round (no plan yet: the opening gives it one)."""
    why: str

    @property
    def round_id(self) -> int:
        return self.round.round_id

    @property
    def participants(self) -> tuple[str, ...]:
        return self.round.participants

    @property
    def fragment(self) -> int:
        return self.round.fragment

    @property
    def base_version(self) -> int:
        """The global version of the fragment the updates must build on (maybe in flight)."""
        return self.round.base_version


@dataclass(frozen=True)
class Close:
    round: Round
    merged: tuple[str, ...]
    late: tuple[Round, ...]
    """Earlier rounds of the same fragment whose late updates are merged here (once), oldest
    first."""
    final: bool
    """The run's last round (``max_rounds`` reached by this close)."""
    why: str


@dataclass(frozen=True)
class Abort:
    round_ids: tuple[int, ...]
    """Every open round: later ones build on the oldest, which cannot complete."""
    why: str


@dataclass(frozen=True)
class Retry:
    """A whole round (its aggregator merges all of its participants or none) lacks some updates:
    the service either retries it with those that remain (``Lifecycle.retry``) or abandons it
    (``Lifecycle.abort``)."""

    round: Round
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


Decision = Open | Close | Abort | Retry | Finish | Remove
