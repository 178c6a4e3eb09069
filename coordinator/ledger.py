"""The round ledger: what the coordinator keeps per round beside the lifecycle, in one record.

The pure :class:`~coordinator.lifecycle.Lifecycle` knows which rounds are open and who sent what;
the ledger keeps what carrying those rounds out needs: each open round's plan, the RoundStart
each participant was sent (to send again after a loss), what each accepted update said (no
tensors), when it landed, and the running sum its tensors were folded into (a masked sum under
secure aggregation, with the attempt's masking plan). Late updates wait, by the round they were
trained for, until their fragment's next sync. Never a site's decoded update: memory is O(model)
plus, for a sparse broadcast only, the updates' encoded bytes, which it forwards.

A round's record is created at its opening and leaves through one of three verbs: ``take`` (it
closed), ``drop`` (it was aborted) or ``restart`` (a secure-aggregation re-run keeps the plan
and starts gathering again).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from comm.codecs.base import EncodedTensor
from comm.security.masking import SecAggConfig
from comm.security.secagg import MaskingPlan
from comm.wire.schema import RoundStart
from coordinator.aggregate import MaskedSum, RunningSum
from coordinator.scheduler import RoundPlan


@dataclass(frozen=True)
class Accepted:
    """An update taken in, as the round's summary needs it (its tensors went into the round's
    running sum)."""

    site_id: str
    round_id: int
    weight: float
    train_loss: float
    compute_seconds: float
    nbytes: int
    encoded: tuple[EncodedTensor, ...] = ()
    """The update as it arrived, kept for a sparse broadcast only (empty otherwise)."""


@dataclass
class RoundRecord:
    """One open round, as the ledger keeps it."""

    plan: RoundPlan
    starts: dict[str, RoundStart] = field(default_factory=dict)
    """The RoundStart each participant was sent; emptied by a re-run (its plans go out once)."""
    accepted: dict[str, Accepted] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)
    """When each on-time update landed (for arrival alignment)."""
    sum: RunningSum = field(default_factory=RunningSum)
    masking: MaskingPlan | None = None
    """Secure aggregation: the current attempt's masking plan."""
    masked: MaskedSum | None = None
    """Secure aggregation: the modular sum of the current attempt's masked vectors."""


class RoundLedger:
    """Per-round records of the open rounds, and the late updates waiting for their sync."""

    def __init__(self, secagg: SecAggConfig | None = None) -> None:
        self._secagg = secagg
        self._open: dict[int, RoundRecord] = {}
        self._late: dict[tuple[str, int], Accepted] = {}
        self._late_sums: dict[int, RunningSum] = {}

    def open(self, round_id: int, plan: RoundPlan, masking: MaskingPlan | None) -> RoundRecord:
        assert round_id not in self._open, f"round {round_id} opened twice"
        record = RoundRecord(plan=plan, masking=masking)
        if masking is not None:
            assert self._secagg is not None
            record.masked = MaskedSum(self._secagg)
        self._open[round_id] = record
        return record

    def get(self, round_id: int) -> RoundRecord | None:
        return self._open.get(round_id)

    def __getitem__(self, round_id: int) -> RoundRecord:
        return self._open[round_id]

    def take(self, round_id: int) -> RoundRecord:
        """The record of a round that closed; the ledger forgets it."""
        return self._open.pop(round_id)

    def drop(self, round_ids: Iterable[int]) -> None:
        """Aborted rounds: what they gathered is void."""
        for round_id in round_ids:
            self._open.pop(round_id, None)

    def restart(self, round_id: int, masking: MaskingPlan) -> RoundRecord:
        """A secure-aggregation re-run: the same plan, a new masking attempt, nothing gathered,
        and no plan to send again (the re-run's go out once)."""
        old = self._open[round_id]
        assert self._secagg is not None
        new = RoundRecord(plan=old.plan, masking=masking, masked=MaskedSum(self._secagg))
        self._open[round_id] = new
        return new

    def plans(self) -> Iterator[tuple[int, RoundPlan]]:
        """(round id, plan) of each open round."""
        for round_id, record in self._open.items():
            yield round_id, record.plan

    def start_for(self, round_id: int, site_id: str) -> RoundStart | None:
        record = self._open.get(round_id)
        return record.starts.get(site_id) if record is not None else None

    # ---- accepted updates ------------------------------------------------------------------

    def accept(self, acc: Accepted, now: float, delta: Mapping[str, np.ndarray]) -> None:
        """An on-time update, folded into its round's running sum."""
        record = self._open[acc.round_id]
        record.sum.add(acc.weight, delta)
        record.accepted[acc.site_id] = acc
        record.arrived[acc.site_id] = now

    def accept_masked(self, acc: Accepted, vectors: Mapping[str, np.ndarray]) -> None:
        """A masked update, folded into its attempt's modular sum."""
        record = self._open[acc.round_id]
        assert record.masked is not None
        record.masked.add(acc.site_id, vectors)
        record.accepted[acc.site_id] = acc

    def accept_late(self, acc: Accepted, delta: Mapping[str, np.ndarray]) -> None:
        """An update whose round closed: kept (as one sum per round, since late updates of one
        round share their staleness weight) until its fragment's next sync."""
        self._late_sums.setdefault(acc.round_id, RunningSum()).add(acc.weight, delta)
        self._late[(acc.site_id, acc.round_id)] = acc

    def take_late(
        self, updates: Iterable[tuple[str, int]]
    ) -> tuple[list[Accepted], list[tuple[int, RunningSum]]]:
        """The late updates ``(site, round)`` merged now, and their sums as (round the updates
        were trained for, sum), oldest first; the ledger forgets them."""
        taken = [self._late.pop(key) for key in updates]
        sums = [(r, self._late_sums.pop(r)) for r in sorted({a.round_id for a in taken})]
        return taken, sums

    @property
    def nbytes(self) -> int:
        """Bytes of tensors kept (running sums): O(model) per open round."""
        open_bytes = sum(
            r.sum.nbytes + (r.masked.nbytes if r.masked is not None else 0)
            for r in self._open.values()
        )
        kept = sum(
            enc.nbytes
            for acc in [a for r in self._open.values() for a in r.accepted.values()]
            + list(self._late.values())
            for enc in acc.encoded
        )
        return open_bytes + kept + sum(s.nbytes for s in self._late_sums.values())

    def __len__(self) -> int:
        return len(self._open)
