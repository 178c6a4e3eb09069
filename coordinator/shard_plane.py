"""How shard 0 of a sharded coordinator keeps the shards' rounds in step: pure bookkeeping.

With ``[coordinator] shards = S`` every shard runs the same rounds over its own tensors, and a
site sends each shard its part of an update. Shard 0 decides (membership, opening, closing);
:class:`ShardPlane` is what it knows of the others, and what it answers to what they report. It
holds no socket and no clock; the shards' messages are its events, its answers are the
decisions shard 0 sends to every shard.

The merged set is the same on every shard. A shard holds each part it took as the bytes it
came as until the round closes (``coordinator.aggregate``: nothing is folded before the close),
so a site's update can still be left out of every shard's mean until then. Each shard checks its
own part of a site's update as a single coordinator checks a whole one (finite, the round's
tensors, the norm bound over its part) and reports the verdict to shard 0, with its part's
squared norm when it took it; shard 0 decides whose updates the round merges. A close goes in
two steps:

1. freeze: shard 0 stops taking parts of the round and asks every shard which sites' parts it
   holds (:meth:`ShardPlane.freeze`, each answer :meth:`ShardPlane.frozen`). The round merges
   the sites whose part every shard holds and took, whose whole update is within the norm
   bound (the square root of the sum of the parts' squared norms: a single coordinator's
   bound on the same update); every other site some shard holds a part of is left out on
   every shard (:class:`CloseAll` names it and why: a shard refused its part, its whole norm
   is over the bound, or a shard holds no part of it). Each shard lets go of what it holds of
   a site left out and closes over exactly the sites merged; the round is aborted everywhere
   (:class:`AbortAll`) only when fewer than its quorum are left. Shard 0 freezes once no
   participant is half-way (:meth:`ShardPlane.partial`), or once the grace ceiling passed;
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
import math
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
    """Every shard closes the round over exactly ``merged``, and lets go of what it holds of
    the sites ``left_out`` (each with why, by site id)."""

    round_id: int
    merged: frozenset[str]
    left_out: tuple[tuple[str, str], ...] = ()


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
    quorum: int = 1
    """The fewest updates the round may merge (the lifecycle's quorum of its participants)."""
    phase: Phase = Phase.OPEN
    opened_by: set[int] = field(default_factory=lambda: {0})
    """Shards that opened the round (shard 0 by opening it)."""
    taken: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per site, the shards that took its part, each with the part's squared norm."""
    refused: dict[str, str] = field(default_factory=dict)
    """Sites a shard refused a part of, with why: their update is merged nowhere."""
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

    def __init__(self, parts: Sequence[Sequence[str]], *, max_norm: float = math.inf) -> None:
        """``max_norm``: the bound on a site's whole update's L2 norm (the aggregator's
        ``max_update_norm``), which no shard can check alone."""
        if not parts:
            raise ValueError("a sharded coordinator has at least one shard")
        self.parts = tuple(frozenset(p) for p in parts)
        self.count = len(self.parts)
        self.max_norm = max_norm
        self._rounds: dict[int, _Round] = {}

    # ---- views -------------------------------------------------------------------------------

    def phase(self, round_id: int) -> Phase:
        return self._round(round_id).phase

    def complete(self, round_id: int) -> frozenset[str]:
        """Sites whose part every shard took, their whole update within the norm bound."""
        r = self._round(round_id)
        return self._complete(r, self._void(r))

    def void(self, round_id: int) -> frozenset[str]:
        """Sites whose update is merged on no shard: a shard refused a part of it, or its
        parts together are over the norm bound."""
        return frozenset(self._void(self._round(round_id)))

    def partial(self, round_id: int) -> frozenset[str]:
        """Sites some shards took a part of and others have not (yet), none refused."""
        r = self._round(round_id)
        void = self._void(r)
        return frozenset(
            s for s, parts in r.taken.items() if len(parts) < self.count and s not in void
        )

    def norm(self, round_id: int, site_id: str) -> float | None:
        """The L2 norm of ``site_id``'s whole update, once every shard took its part: the
        square root of its parts' squared norms summed in shard order. One coordinator sums the
        same squares tensor by tensor in another order, so the two may differ in their last
        bits; the bound judges them alike except for an update within a few ulps of it."""
        return self._norm(self._round(round_id), site_id)

    # ---- events ------------------------------------------------------------------------------

    def opened(self, round_id: int, participants: Sequence[str], quorum: int = 1) -> None:
        """Shard 0 opened ``round_id`` (every shard opens it from shard 0's plan); it may
        merge no fewer than ``quorum`` updates."""
        if round_id in self._rounds:
            raise ValueError(f"round {round_id} is opened twice")
        self._rounds[round_id] = _Round(frozenset(participants), quorum=quorum)

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

    def folded(self, shard: int, round_id: int, site_id: str, squared_norm: float = 0.0) -> None:
        """Shard ``shard`` took ``site_id``'s part of ``round_id`` (checked, held until the
        close), whose values' squares sum to ``squared_norm``."""
        r = self._in(round_id, shard, Phase.OPEN, Phase.FREEZING)
        if site_id not in r.participants:
            raise ValueError(f"round {round_id}: {site_id!r} is not a participant")
        if not (math.isfinite(squared_norm) and squared_norm >= 0):
            raise ValueError(f"round {round_id}: {site_id!r}'s part has norm² {squared_norm}")
        r.taken.setdefault(site_id, {})[shard] = squared_norm

    def refused(self, shard: int, round_id: int, site_id: str, why: str = "") -> None:
        """Shard ``shard`` refused ``site_id``'s part of ``round_id``: the site's update is
        merged on no shard (each lets go of what it holds of it at the close). A refusal from a
        shard that took the site's part already (a second copy, refused as a duplicate) changes
        nothing: the part it holds stands."""
        r = self._in(round_id, shard, Phase.OPEN, Phase.FREEZING)
        if shard in r.taken.get(site_id, {}):
            return
        detail = f": {why}" if why else ""
        r.refused.setdefault(site_id, f"shard {shard} refused its part{detail}")

    def freeze(self, round_id: int) -> None:
        """Shard 0 closes ``round_id`` to further parts and asks the shards what they hold."""
        r = self._in(round_id, 0, Phase.OPEN)
        r.phase = Phase.FREEZING

    def frozen(
        self, shard: int, round_id: int, folded: frozenset[str]
    ) -> CloseAll | AbortAll | None:
        """Shard ``shard`` froze ``round_id`` holding the parts of ``folded``. None until every
        shard has answered; then :class:`CloseAll` over the sites every shard holds and took,
        within the norm bound, naming every other site some shard holds (left out everywhere);
        :class:`AbortAll` when fewer than the round's quorum are merged."""
        r = self._in(round_id, shard, Phase.FREEZING)
        if shard in r.frozen:
            raise ValueError(f"round {round_id}: shard {shard} froze twice")
        r.frozen[shard] = frozenset(folded)
        if len(r.frozen) < self.count:
            return None
        sets = list(r.frozen.values())
        void = self._void(r)
        merged = frozenset.intersection(*sets) & self._complete(r, void)
        left = tuple(
            (s, self._left_out(r, s, void)) for s in sorted(frozenset.union(*sets) - merged)
        )
        if not merged:
            why = "no update every shard holds and took"
            return self._abort(r, round_id, why + "".join(f"; {s}: {w}" for s, w in left[:3]))
        if len(merged) < r.quorum:
            return self._abort(
                r,
                round_id,
                f"{len(merged)} updates every shard holds and took, quorum {r.quorum}"
                + "".join(f"; {s}: {w}" for s, w in left[:3]),
            )
        r.phase, r.merged = Phase.PREPARING, merged
        return CloseAll(round_id, merged, left)

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

    def _void(self, r: _Round) -> dict[str, str]:
        """Sites whose update is merged nowhere, with why."""
        void = dict(r.refused)
        for site in r.taken:
            if site in void:
                continue
            norm = self._norm(r, site)
            if norm is not None and norm > self.max_norm:
                void[site] = (
                    f"update norm {norm:.3g} > bound {self.max_norm:.3g} (its {self.count} "
                    "shards' parts together)"
                )
        return void

    def _norm(self, r: _Round, site_id: str) -> float | None:
        parts = r.taken.get(site_id, {})
        if len(parts) < self.count:
            return None
        total = 0.0
        for shard in range(self.count):  # the parts in shard order: the same sum every time
            total += parts[shard]
        return math.sqrt(total)

    def _complete(self, r: _Round, void: Mapping[str, str]) -> frozenset[str]:
        return frozenset(
            s for s, parts in r.taken.items() if len(parts) == self.count and s not in void
        )

    def _left_out(self, r: _Round, site_id: str, void: Mapping[str, str]) -> str:
        """Why a site some shard holds a part of is merged nowhere."""
        if site_id in void:
            return void[site_id]
        missing = [s for s in range(self.count) if site_id not in r.frozen[s]]
        if missing:
            return f"shard {missing[0]} holds no part of it at the freeze"
        unheard = [s for s in range(self.count) if s not in r.taken.get(site_id, {})]
        return f"shard {unheard[0]} never said it took its part"

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
