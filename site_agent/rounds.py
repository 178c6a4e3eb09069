"""The site's round state as a pure state machine: events in, actions out.

Events: a round's plan arrived (``round_start``), rounds were cancelled (``round_cancel``), a
global version was applied (``global_applied``), the coordinator forgot this site and it joins
again (``rejoin``), the federation stops (``shutdown``). Actions (:data:`RoundAction`): between
rounds (:meth:`SiteRounds.next_action`) train a round, wait, drop a plan, or stop; once a round's
slot is trained (:meth:`SiteRounds.slot_done`) send its update, wait, or drop it. No sockets and no
clock: the site agent does the I/O around it.

The rules. Plans are trained in the order they arrived. A plan is dropped when it was
cancelled or its round already closed without this site (the global version reached it); the
progress is not lost, it goes out with the next update. Without overlap the site trains nothing
after sending a round's update until that round's result is applied, or the round is cancelled
(its result never comes). An update is sent only on top of its fragment's previous result
(``fragment_base_version``); the site waits for it unless the round is cancelled meanwhile. No
round's update goes out twice, and a cancelled round's never.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from comm.wire.schema import RoundStart

MAX_PENDING = 16
"""Plans held at most; the coordinator keeps two rounds in flight, so more means this site fell
far behind: the oldest plans are dropped (their rounds close without this site)."""
MAX_CANCELLED = 64
"""Cancelled round ids remembered at most (only ids above the global version are kept: rounds at
or below it are over anyway)."""


@dataclass(frozen=True)
class Train:
    """Train this round's slot of inner steps now."""

    plan: RoundStart


@dataclass(frozen=True)
class Send:
    """Send this round's update now."""

    plan: RoundStart


@dataclass(frozen=True)
class Wait:
    """Block on the link for the next message."""

    reason: str


@dataclass(frozen=True)
class Drop:
    """A plan given up (its progress stays local and goes out with the next update)."""

    round_id: int
    reason: str


@dataclass(frozen=True)
class Stop:
    """The federation is finished: nothing more to do."""


RoundAction = Train | Send | Wait | Drop | Stop
"""What the site does next about its rounds (the coordinator's verdicts are another thing)."""


class SiteRounds:
    """Which rounds a site trains, sends, drops, and when it blocks."""

    def __init__(self, global_version: int = -1) -> None:
        self.global_version = global_version
        self.pending: deque[RoundStart] = deque()
        self.cancelled: set[int] = set()
        self.awaiting: int | None = None
        """Without overlap: the round whose result must be applied before training on."""
        self.training: RoundStart | None = None
        """The round whose slot is being trained (between ``Train`` and its ``Send``/``Drop``)."""
        self.last_sent = -1
        """The highest round id whose update was sent (round ids only grow)."""
        self.stopped = False
        self._abandoned = False  # the training round was given up (rejoin) or cancelled
        self._dropped: deque[Drop] = deque()

    # ---- events ---------------------------------------------------------------------------

    def round_start(self, plan: RoundStart) -> None:
        rid = plan.round_id
        seen = rid <= self.last_sent or any(p.round_id == rid for p in self.pending)
        if seen or (self.training is not None and self.training.round_id == rid):
            return  # a plan delivered twice: one update per round
        self.pending.append(plan)
        while len(self.pending) > MAX_PENDING:
            old = self.pending.popleft()
            self._dropped.append(Drop(old.round_id, "too many plans held"))

    def round_cancel(self, round_ids: Iterable[int]) -> None:
        ids = set(round_ids)
        self.cancelled |= {r for r in ids if r > self.global_version}
        while len(self.cancelled) > MAX_CANCELLED:
            self.cancelled.discard(min(self.cancelled))
        if self.awaiting in ids:
            self.awaiting = None  # its result will never come
        if self.training is not None and self.training.round_id in ids:
            self._abandoned = True

    def global_applied(self, version: int) -> None:
        self.global_version = version
        self.cancelled = {r for r in self.cancelled if r > version}
        if self.awaiting is not None and version >= self.awaiting:
            self.awaiting = None

    def rejoin(self) -> None:
        """The coordinator does not know this site: plans and waits are void."""
        for plan in self.pending:
            self._dropped.append(Drop(plan.round_id, "joining again"))
        self.pending.clear()
        self.awaiting = None
        if self.training is not None:
            self._abandoned = True

    def shutdown(self) -> None:
        self.stopped = True

    # ---- actions --------------------------------------------------------------------------

    def next_action(self) -> RoundAction:
        """Between rounds: what to do now."""
        if self.stopped:
            return Stop()
        assert self.training is None, "slot_done() first"
        if self._dropped:
            return self._dropped.popleft()
        if self.pending:
            head = self.pending[0]
            why = self._void(head)
            if why:
                self.pending.popleft()
                return Drop(head.round_id, why)
        if self.awaiting is not None and self.global_version < self.awaiting:
            return Wait(f"the result of round {self.awaiting} (no overlap)")
        if not self.pending:
            return Wait("no plan")
        self.awaiting = None
        self.training = self.pending.popleft()
        self._abandoned = False
        return Train(self.training)

    def slot_done(self) -> RoundAction:
        """The training round's slot is trained: send, wait for its base, or drop it."""
        if self.stopped:
            return Stop()
        plan = self.training
        assert plan is not None, "no round in training"
        why = "abandoned" if self._abandoned else self._void(plan, closed=False)
        if why:
            self.training = None
            return Drop(plan.round_id, why)
        if self.global_version < plan.fragment_base_version:
            return Wait(f"global v{plan.fragment_base_version} before round {plan.round_id}")
        self.training = None
        self.last_sent = max(self.last_sent, plan.round_id)
        if not plan.overlap:
            self.awaiting = plan.round_id
        return Send(plan)

    def _void(self, plan: RoundStart, *, closed: bool = True) -> str:
        if plan.round_id in self.cancelled:
            return "cancelled"
        if closed and plan.round_id <= self.global_version:
            return "closed without this site"
        return ""
