"""How shard 0 of a sharded coordinator keeps the shards' rounds in step: pure bookkeeping.

With ``[coordinator] shards = S`` every shard runs the same rounds over its own tensors, and a
site sends each shard its part of an update. Shard 0 decides (membership, opening, closing);
:class:`ShardPlane` is what it knows of the others, and what it answers to what they report. It
holds no socket and no clock; the shards' messages are its events, its answers are the
decisions shard 0 sends to every shard.

The merged set is the same on every shard, or the round is aborted everywhere. A fold cannot be
taken back exactly, so a site whose part one shard folded and another never did (or refused)
cannot be left out of one shard's mean and kept in another's. A close therefore goes in two
steps:

1. freeze: shard 0 stops taking parts of the round and asks every shard which sites' parts it
   folded (:meth:`ShardPlane.freeze`, each answer :meth:`ShardPlane.frozen`); when every shard
   holds the same sites, every shard closes over exactly those (:class:`CloseAll`), else the
   round is aborted everywhere (:class:`AbortAll`). Shard 0 freezes once no participant is
   half-way (:meth:`ShardPlane.partial`), so an abort needs a site that failed between its parts;
2. commit: each shard (shard 0 too) runs the outer step over its tensors, saves its new version
   and reports its tensors' digests (:meth:`ShardPlane.prepared`); once every shard has, shard
   0 writes its commit record (``coordinator.shard_commit``), which is the commit, and every
   shard announces its result (:class:`CommitAll`, with the combined state hash,
   ``comm.wire.partition.combined_hash``).

A shard is thus at most one version ahead of the record (it saved a version never committed):
:func:`resume` tells a shard that meets shard 0 again which version it must run, and
``coordinator.shard_commit.start_version`` tells shard 0 itself at its start.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from comm.wire.partition import combined_hash, shard_hash


class Phase(enum.Enum):
    OPEN = "open"
    FREEZING = "freezing"
    PREPARING = "preparing"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class CloseAll:
    """Every shard closes the round over exactly ``merged``."""

    round_id: int
    merged: frozenset[str]


@dataclass(frozen=True)
class AbortAll:
    """Every shard aborts the round (a shard that saved its version goes back to the last
    committed one)."""

    round_id: int
    why: str


@dataclass(frozen=True)
class CommitAll:
    """Every shard announces its result of the round: ``version`` is committed, and the model's
    state hash over every shard is ``combined_hash``."""

    round_id: int
    version: int
    combined_hash: str
    shard_hashes: tuple[str, ...]


@dataclass
class _Round:
    participants: frozenset[str]
    phase: Phase = Phase.OPEN
    opened_by: set[int] = field(default_factory=lambda: {0})
    """Shards that opened the round (shard 0 by opening it)."""
    folded: dict[str, set[int]] = field(default_factory=dict)
    """Per site, the shards that folded its part."""
    poisoned: set[str] = field(default_factory=set)
    """Sites a shard refused a part of: their update cannot be merged whole anywhere."""
    frozen: dict[int, frozenset[str]] = field(default_factory=dict)
    merged: frozenset[str] = frozenset()
    version: int | None = None
    digests: dict[int, Mapping[str, bytes]] = field(default_factory=dict)
    hashes: dict[int, str] = field(default_factory=dict)


class ShardPlane:
    """Shard 0's record of every shard's part in the rounds in flight (see the module doc).

    ``parts`` is the partition (``comm.wire.partition.partition``): shard s reports digests of
    exactly ``parts[s]``. A report that breaks the protocol (an unknown shard or round, a phase
    it does not belong to) raises ValueError naming it; nothing is changed by it."""

    def __init__(self, parts: Sequence[Sequence[str]]) -> None:
        if not parts:
            raise ValueError("a sharded coordinator has at least one shard")
        self.parts = tuple(frozenset(p) for p in parts)
        self.count = len(self.parts)
        self._rounds: dict[int, _Round] = {}

    # ---- views -------------------------------------------------------------------------------

    def phase(self, round_id: int) -> Phase:
        return self._round(round_id).phase

    def complete(self, round_id: int) -> frozenset[str]:
        """Sites whose part every shard folded (a refused part counts against its site)."""
        r = self._round(round_id)
        return frozenset(
            s for s, shards in r.folded.items() if len(shards) == self.count and s not in r.poisoned
        )

    def void(self, round_id: int) -> frozenset[str]:
        """Sites a shard refused a part of: their update counts on no shard."""
        return frozenset(self._round(round_id).poisoned)

    def partial(self, round_id: int) -> frozenset[str]:
        """Sites some shards folded a part of and others have not (yet)."""
        r = self._round(round_id)
        return frozenset(
            s for s, shards in r.folded.items() if len(shards) < self.count or s in r.poisoned
        )

    # ---- events ------------------------------------------------------------------------------

    def opened(self, round_id: int, participants: Sequence[str]) -> None:
        """Shard 0 opened ``round_id`` (every shard opens it from shard 0's plan)."""
        if round_id in self._rounds:
            raise ValueError(f"round {round_id} is opened twice")
        self._rounds[round_id] = _Round(frozenset(participants))

    def acknowledged(self, shard: int, round_id: int) -> bool:
        """Shard ``shard`` opened ``round_id``; True when every shard now has (the round may be
        announced to the sites: each shard takes their parts)."""
        r = self._in(round_id, shard, Phase.OPEN)
        before = len(r.opened_by)
        r.opened_by.add(shard)
        return len(r.opened_by) == self.count > before

    def ready(self, round_id: int) -> bool:
        """Every shard opened ``round_id``."""
        return len(self._round(round_id).opened_by) == self.count

    def folded(self, shard: int, round_id: int, site_id: str) -> None:
        """Shard ``shard`` folded ``site_id``'s part of ``round_id``."""
        r = self._in(round_id, shard, Phase.OPEN, Phase.FREEZING)
        if site_id not in r.participants:
            raise ValueError(f"round {round_id}: {site_id!r} is not a participant")
        r.folded.setdefault(site_id, set()).add(shard)

    def refused(self, shard: int, round_id: int, site_id: str) -> None:
        """Shard ``shard`` refused ``site_id``'s part of ``round_id``: the site's update is
        void on every shard; a shard that folded its part makes the round unable to close
        with or without it (the freeze finds the shards' sets differ)."""
        r = self._in(round_id, shard, Phase.OPEN, Phase.FREEZING)
        r.poisoned.add(site_id)

    def freeze(self, round_id: int) -> None:
        """Shard 0 closes ``round_id`` to further parts and asks the shards what they folded."""
        r = self._in(round_id, 0, Phase.OPEN)
        r.phase = Phase.FREEZING

    def frozen(
        self, shard: int, round_id: int, folded: frozenset[str]
    ) -> CloseAll | AbortAll | None:
        """Shard ``shard`` froze ``round_id`` holding the parts of ``folded``. None until every
        shard has answered; then :class:`CloseAll` when they hold the same sites (and none was
        refused anywhere), else :class:`AbortAll`."""
        r = self._in(round_id, shard, Phase.FREEZING)
        if shard in r.frozen:
            raise ValueError(f"round {round_id}: shard {shard} froze twice")
        r.frozen[shard] = frozenset(folded)
        if len(r.frozen) < self.count:
            return None
        sets = set(r.frozen.values())
        if len(sets) > 1:
            differ = sorted(frozenset.union(*sets) - frozenset.intersection(*sets))
            return self._abort(r, round_id, f"shards folded different sites: {differ[:3]}")
        (merged,) = sets
        poisoned = sorted(merged & r.poisoned)
        if poisoned:
            return self._abort(r, round_id, f"a shard refused a part of {poisoned[:3]}")
        if not merged:
            return self._abort(r, round_id, "no shard folded any update")
        r.phase, r.merged = Phase.PREPARING, merged
        return CloseAll(round_id, merged)

    def prepared(
        self, shard: int, round_id: int, version: int, digests: Mapping[str, bytes]
    ) -> CommitAll | AbortAll | None:
        """Shard ``shard`` saved ``version`` of its tensors after ``round_id``'s outer step,
        whose digests are ``digests``. None until every shard has; then :class:`CommitAll`
        with the combined hash, or :class:`AbortAll` when the shards disagree on the version."""
        r = self._in(round_id, shard, Phase.PREPARING)
        if shard in r.digests:
            raise ValueError(f"round {round_id}: shard {shard} prepared twice")
        if set(digests) != self.parts[shard]:
            extra = sorted(set(digests) - self.parts[shard])
            missing = sorted(self.parts[shard] - set(digests))
            raise ValueError(
                f"round {round_id}: shard {shard} digested other tensors than it owns "
                f"(extra {extra[:3]}, missing {missing[:3]})"
            )
        if r.version is None:
            r.version = version
        elif version != r.version:
            return self._abort(
                r, round_id, f"shard {shard} prepared version {version}, others {r.version}"
            )
        r.digests[shard] = dict(digests)
        r.hashes[shard] = shard_hash(digests)
        if len(r.digests) < self.count:
            return None
        r.phase = Phase.COMMITTED
        whole = combined_hash(r.digests[s] for s in range(self.count))
        return CommitAll(round_id, version, whole, tuple(r.hashes[s] for s in range(self.count)))

    def abort(self, round_id: int, why: str) -> AbortAll:
        """Shard 0 gives ``round_id`` up (its lifecycle aborted it, a shard left, a deadline)."""
        r = self._round(round_id)
        if r.phase is Phase.COMMITTED:
            raise ValueError(f"round {round_id} is committed: it cannot be aborted")
        return self._abort(r, round_id, why)

    def in_flight(self) -> tuple[int, ...]:
        """Rounds neither committed nor aborted, oldest first."""
        done = (Phase.COMMITTED, Phase.ABORTED)
        return tuple(sorted(i for i, r in self._rounds.items() if r.phase not in done))

    def abort_in_flight(self, why: str) -> tuple[int, ...]:
        """Every round in flight aborted (a shard left or came back without what it folded);
        their ids. A round preparing is aborted too: no shard has announced it."""
        ids = self.in_flight()
        for round_id in ids:
            self._abort(self._rounds[round_id], round_id, why)
        return ids

    def forget(self, round_id: int) -> None:
        """A committed or aborted round, done with."""
        r = self._round(round_id)
        if r.phase not in (Phase.COMMITTED, Phase.ABORTED):
            raise ValueError(f"round {round_id} is still {r.phase.value}")
        del self._rounds[round_id]

    # ---- internals ---------------------------------------------------------------------------

    def _abort(self, r: _Round, round_id: int, why: str) -> AbortAll:
        r.phase = Phase.ABORTED
        return AbortAll(round_id, why)

    def _round(self, round_id: int) -> _Round:
        r = self._rounds.get(round_id)
        if r is None:
            raise ValueError(f"round {round_id} is not one shard 0 opened")
        return r

    def _in(self, round_id: int, shard: int, *phases: Phase) -> _Round:
        if not 0 <= shard < self.count:
            raise ValueError(f"shard {shard} is not one of {self.count}")
        r = self._round(round_id)
        if r.phase not in phases:
            raise ValueError(
                f"round {round_id} is {r.phase.value}, not {' or '.join(p.value for p in phases)}"
            )
        return r


@dataclass(frozen=True)
class Resume:
    """What a shard does on meeting shard 0: run ``version``; ``roll_back``: its newest saved
    version was never committed, and it loads the one before."""

    version: int
    roll_back: bool


def resume(committed: int, held: int) -> Resume:
    """A shard holding version ``held`` meets shard 0, whose last committed version is
    ``committed``. A shard saves a version before shard 0 commits it, so it holds the committed
    one or the next (to roll back: a version is its round's id, and rounds aborted in between
    took the ids before it); an older one is a state from another history (a restored backup,
    another federation), and ValueError says so."""
    if held == committed:
        return Resume(committed, False)
    if held > committed:
        return Resume(committed, True)
    raise ValueError(
        f"this shard holds version {held} and shard 0 committed {committed}: a shard holds the "
        "committed version or the one after; restore every shard's state from the same backup"
    )
