"""One round as one object: who takes part, its plan, the updates it accepted (folded as they
land through the federation's aggregator) and, once closed, the late updates it still takes.

A :class:`Round` covers the tensors it is given (``tensors``: a fragment's, or a shard's share
of one) and nothing else of the model; it knows no socket and no clock (``now`` is an
argument). Every fact about a round is recorded here once: the lifecycle decides over rounds
(open, close, abort, retry), the opening plans them, the closing merges them.

A round is open until :meth:`Round.close` (it merged ``merged``) or :meth:`Round.abort` (it
merged nothing). A closed round that merged takes late updates from its participants that
missed it, within the staleness horizon, unless its aggregator refuses them; they wait in a fold
of their own until a later close of the same fragment takes them (:meth:`Round.take_late`).
A close lists the late updates it merges in the order they were accepted, across rounds
(:attr:`Accepted.order`); their sums go by round whatever that order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from comm.wire.schema import ErrorCode, Update
from coordinator.aggregate import Aggregator, Fold, Late, Refused, RoundResult
from coordinator.rounds import OpenRound
from coordinator.scheduler import RoundPlan

_acceptance = itertools.count()
"""The order in which this process accepts updates, across every round."""


class Charge(Protocol):
    """An accepted update's bytes charged to its sender while a round holds them
    (``coordinator.allowance.hold_update``)."""

    def release(self) -> None:
        """Give the bytes back (once; later calls do nothing)."""


@dataclass(frozen=True)
class UpdateRefusal:
    """An update that may not be accepted: the Error code and detail its sender is told."""

    code: ErrorCode
    detail: str
    reason: str = ""
    """The refusals counter's label (empty: the code's name)."""


@dataclass(frozen=True)
class Accepted:
    """An update taken in, as the round's summary needs it (its tensors went into a fold)."""

    site_id: str
    round_id: int
    weight: float
    train_loss: float
    compute_seconds: float
    nbytes: int
    order: int = 0
    """Its place in the order this process accepted updates in, across rounds: a close lists
    the late updates it merges by it."""


@dataclass(frozen=True)
class Taken:
    """An update a round accepted."""

    update: Accepted
    late: bool
    """Its round had closed: it waits for its fragment's next sync."""
    lag_s: float | None
    """How long after the round's quorum it landed (None: before, or late)."""
    note: str
    """The aggregator's words on it, for the log."""


@dataclass(eq=False)
class Round:
    """One round; see the module docstring."""

    round_id: int
    fragment: int
    num_fragments: int
    base_version: int
    """The version of the fragment the updates must build on (maybe still in flight)."""
    participants: tuple[str, ...]
    opened_at: float
    deadline_at: float
    quorum: int
    """Updates the round needs to close before every participant sent one."""
    aggregator: Aggregator
    fold: Fold | None
    """The current attempt's aggregate of the on-time updates (None once closed or aborted:
    the close took its result)."""
    plan: RoundPlan | None = None
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """The tensors the round covers, by name and shape (set with the plan)."""
    accepted: dict[str, Accepted] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)
    """When each on-time update landed (for arrival alignment), where the aggregator says
    that times its site's training (``Aggregator.arrivals_time_training``)."""
    quorum_at: float | None = None
    """When the quorum's last needed update arrived (None: not yet)."""
    dropped: frozenset[str] = frozenset()
    """Participants that will never send their update: they joined again (a restarted site
    holds no plan), so they count as gone although they are members."""
    merged: frozenset[str] | None = None
    """Whose on-time updates the close merged (None while open; empty: aborted)."""
    late: dict[str, Accepted] = field(default_factory=dict)
    """Late updates taken, merged or not."""
    late_waiting: list[Accepted] = field(default_factory=list)
    late_fold: Fold | None = None
    """The late updates not merged yet."""
    frozen: bool = False
    """A round of a coordinator of several shards being closed: it takes no more updates, on
    time or late, so every shard merges the same ones (``coordinator.shard_plane``)."""
    charges: dict[str, Charge] = field(default_factory=dict)
    """What the on-time updates held cost their senders, until the result is taken or the
    attempt is let go (:meth:`retry`, :meth:`abort`)."""
    late_charges: dict[str, Charge] = field(default_factory=dict)
    """What the late updates waiting cost their senders, until a later close takes them."""

    # ---- views ---------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self.merged is None

    @property
    def received(self) -> frozenset[str]:
        return frozenset(self.accepted)

    def awaits(self, site_id: str) -> bool:
        """Whether the round waits on ``site_id``'s update: it takes part, has not sent it, and
        was not dropped."""
        return (
            self.is_open
            and site_id in self.participants
            and site_id not in self.accepted
            and site_id not in self.dropped
        )

    def view(self) -> OpenRound:
        """The round as the pure decision (``coordinator.rounds.decide``) reads it."""
        return OpenRound(
            round_id=self.round_id,
            base_version=self.base_version,
            participants=self.participants,
            opened_at=self.opened_at,
            deadline_at=self.deadline_at,
            received=self.received,
            quorum_at=self.quorum_at,
            fragment=self.fragment,
            dropped=self.dropped,
        )

    # ---- updates -------------------------------------------------------------------------------

    def check(
        self, site_id: str, fragment: int, trained_from: int, *, staleness: int, horizon: int
    ) -> UpdateRefusal | None:
        """Whether an update may be accepted (None: it may); changes nothing. ``staleness``:
        rounds opened since this one; ``horizon``: the most a late update may have."""
        if site_id not in self.participants:
            return UpdateRefusal(ErrorCode.UNEXPECTED, f"not in round {self.round_id}")
        merged = self.merged or frozenset()
        if site_id in self.accepted or site_id in merged or site_id in self.late:
            return UpdateRefusal(ErrorCode.DUPLICATE, f"round {self.round_id}")
        if fragment != self.fragment:
            return UpdateRefusal(
                ErrorCode.BAD_PAYLOAD, f"fragment {fragment}, round has {self.fragment}"
            )
        if self.frozen:  # every shard merges the same updates: none after the freeze, late or not
            state = "closing" if self.is_open else "closed"
            return UpdateRefusal(
                ErrorCode.STALE_ROUND, f"round {self.round_id} is {state} on every shard"
            )
        if self.is_open:
            if trained_from < self.base_version:
                detail = f"trained from v{trained_from}, round needs v{self.base_version}"
                return UpdateRefusal(ErrorCode.STALE_ROUND, detail)
            return None
        if staleness > horizon or not merged:
            detail = f"round {self.round_id} closed {staleness} rounds ago or was aborted"
            return UpdateRefusal(ErrorCode.STALE_ROUND, detail)
        if self.aggregator.late_refusal:
            detail = f"round {self.round_id} is closed; {self.aggregator.late_refusal}"
            return UpdateRefusal(ErrorCode.STALE_ROUND, detail)
        return None

    def take(
        self,
        now: float,
        msg: Update,
        *,
        staleness: int,
        horizon: int,
        charge: Charge | None = None,
    ) -> UpdateRefusal | Taken:
        """Check an update, fold its tensors in (the on-time fold, or the late one) and record
        it: a refusal changes nothing (``charge``, what holding it costs its sender, is given
        back). An update taken keeps its ``charge`` until the round lets go of it."""
        verdict = self._take(now, msg, staleness=staleness, horizon=horizon)
        if charge is not None:
            if isinstance(verdict, UpdateRefusal):
                charge.release()
            elif verdict.late:
                self.late_charges[msg.site_id] = charge
            else:
                self.charges[msg.site_id] = charge
        return verdict

    def _take(
        self, now: float, msg: Update, *, staleness: int, horizon: int
    ) -> UpdateRefusal | Taken:
        refusal = self.check(
            msg.site_id, msg.fragment, msg.global_version, staleness=staleness, horizon=horizon
        )
        if refusal is not None:
            return refusal
        late = not self.is_open
        if not late:
            fold = self.fold
        elif self.late_fold is not None:
            fold = self.late_fold
        else:
            fold = self.aggregator.late_fold()  # kept only once it takes an update
        assert fold is not None, "an open round has a fold"
        folded = fold.add(msg.site_id, msg.weight, msg.payload, self.tensors)
        if isinstance(folded, Refused):
            return UpdateRefusal(folded.code, folded.detail)
        if late:
            self.late_fold = fold
        acc = Accepted(
            msg.site_id,
            msg.round_id,
            msg.weight,
            msg.train_loss,
            msg.compute_seconds,
            sum(enc.nbytes for enc in msg.payload),
            next(_acceptance),
        )
        if late:
            self.late[msg.site_id] = acc
            self.late_waiting.append(acc)
            return Taken(acc, True, None, folded)
        self.accepted[msg.site_id] = acc
        if self.aggregator.arrivals_time_training:
            self.arrived[msg.site_id] = now
        lag = None
        if self.quorum_at is None:
            if len(self.accepted) >= self.quorum:
                self.quorum_at = now
        else:
            lag = now - self.quorum_at
        return Taken(acc, False, lag, folded)

    # ---- transitions ---------------------------------------------------------------------------

    def drop(self, site_id: str) -> None:
        """A participant that will never send its update (it joined again)."""
        if site_id in self.participants and site_id not in self.accepted:
            self.dropped = self.dropped | {site_id}

    def leave_out(self, site_id: str) -> None:
        """An on-time update taken and not merged after all (the shards of a coordinator agreed
        to merge it nowhere, ``coordinator.shard_plane``): the fold lets go of it, its sender's
        charge is given back, and the round holds it as never received."""
        if site_id not in self.accepted:
            return
        assert self.fold is not None and self.is_open, "an open round leaves an update out"
        self.fold.leave_out(site_id)
        del self.accepted[site_id]
        self.arrived.pop(site_id, None)
        charge = self.charges.pop(site_id, None)
        if charge is not None:
            charge.release()

    def retry(
        self, survivors: tuple[str, ...], fold: Fold, deadline_at: float, quorum: int
    ) -> None:
        """A whole round starts over with ``survivors`` and ``fold``, its next attempt: nothing
        gathered, no plan to send again (the retry's go out once)."""
        self.participants = survivors
        self.fold = fold
        _release(self.charges)
        self.accepted, self.arrived = {}, {}
        self.dropped = frozenset()
        self.quorum_at = None
        self.deadline_at = deadline_at
        self.quorum = quorum

    def close(self, merged: tuple[str, ...]) -> None:
        self.merged = frozenset(merged)

    def abort(self) -> None:
        """What the round gathered is void, its late updates too (a close undone: nothing
        merges them)."""
        self.merged = frozenset()
        self.fold = None
        self.accepted, self.arrived = {}, {}
        self.late_waiting, self.late_fold = [], None
        _release(self.charges)
        _release(self.late_charges)

    def take_late(self, round_id: int) -> tuple[list[Accepted], Late]:
        """The late updates waiting, merged now by round ``round_id`` of the same fragment: down-
        weighted by 1 + the syncs of the fragment they missed (at least one)."""
        assert self.late_fold is not None
        taken, fold = self.late_waiting, self.late_fold
        self.late_waiting, self.late_fold = [], None
        _release(self.late_charges)
        divisor = 1 + max(1, (round_id - self.round_id) // self.num_fragments)
        return taken, Late(self.round_id, divisor, fold)

    def result(self, earlier: Sequence[Round] = ()) -> tuple[RoundResult, list[Accepted]]:
        """What the strategy merges: this round's on-time updates and the late updates waiting
        in ``earlier`` rounds of its fragment (which let go of them), and those late updates in
        the order they were accepted. The round lets go of its fold, and every update it takes
        gives its sender's charge back: the result holds them until the step has read them."""
        fold, self.fold = self.fold, None
        assert fold is not None and not self.is_open, "a closed round's result, once"
        late: list[Accepted] = []
        folds: list[Late] = []
        for r in earlier:
            taken, lf = r.take_late(self.round_id)
            late += taken
            folds.append(lf)
        late.sort(key=lambda u: u.order)
        result = fold.result(str(self.round_id), folds)
        _release(self.charges)
        return result, late


def _release(charges: dict[str, Charge]) -> None:
    """Give back every charge of ``charges`` and forget them."""
    for charge in charges.values():
        charge.release()
    charges.clear()
