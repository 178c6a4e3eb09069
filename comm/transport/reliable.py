"""Acknowledged delivery: per-peer sequence numbers, cumulative acknowledgements, resends.

A message that must arrive (:data:`MUST_ARRIVE`: plans, results, deltas, models, updates,
cancels, joins ...) gets the next number of the stream from this endpoint to its peer and stays
held until the peer acknowledges it. Each end tells the other, on every message it sends anyway
(heartbeats, their echoes, anything), the highest number it holds with none missing before it,
plus the numbers it holds above a gap (a selective acknowledgement). The sender resends what is
unacknowledged after a timeout derived from the measured round trip, the message's size at the
measured goodput and how often the peer speaks; the receiver drops what it already has and
delivers in number order, holding back what arrives after a gap until the gap fills.

:class:`OutStream` is the sending side of one stream, :class:`InStream` the receiving side; both
are pure state machines (the channel endpoint owns the clock and the socket). A stream is named
by its sender's session: an acknowledgement names the session it acknowledges, so one meant for
an earlier incarnation of a peer never clears what is held for the current one. A message the
sender gives up on (its bound of held bytes is exceeded, or the peer restarted) moves the
stream's *floor*, which every numbered message carries: the receiver stops waiting for anything
at or below it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from comm.wire.schema import (
    Eval,
    Global,
    InitParams,
    Join,
    Leave,
    Message,
    RoundCancel,
    RoundStart,
    ShardAbort,
    ShardClose,
    ShardCommit,
    ShardFolded,
    ShardFreeze,
    ShardFrozen,
    ShardInitial,
    ShardInitialDone,
    ShardOpen,
    ShardOpened,
    ShardPrepared,
    Shutdown,
    StepGrad,
    StepMean,
    SyncRequest,
    Update,
    Welcome,
)

T = TypeVar("T")

MUST_ARRIVE: frozenset[type] = frozenset(
    {
        Join,
        Welcome,
        Leave,
        InitParams,
        RoundStart,
        RoundCancel,
        Update,
        Global,
        Eval,
        Shutdown,
        SyncRequest,
        StepGrad,
        StepMean,
        # Between a coordinator's shards: every step of a round's protocol (not the hellos,
        # which are liveness and go again anyway).
        ShardOpen,
        ShardOpened,
        ShardFolded,
        ShardFreeze,
        ShardFrozen,
        ShardClose,
        ShardPrepared,
        ShardCommit,
        ShardAbort,
        ShardInitial,
        ShardInitialDone,
    }
)
"""Message types delivered with acknowledgements. Heartbeats are liveness (a late one is
worthless), chunks and chunk acknowledgements have their own recovery, and an ``Error`` answers
a message that was refused: sending it again would say nothing new."""

MAX_SACK = 64
"""Most numbers above the gap one acknowledgement lists."""

MAX_BACKOFF = 4
"""Each resend of a message without an acknowledgement doubles its timeout, up to 2**this."""


@dataclass
class Held:
    """One message held until the peer acknowledges it."""

    rseq: int
    msg: Message
    nbytes: int = 0
    """Its size on the wire (0 until it first went out)."""
    sent_at: float | None = None
    """When it last went out whole (None: queued, in transfer, or never sent)."""
    sends: int = 0
    """Times it went out, or was tried and could not (each backs its timeout off)."""
    failed: bool = False
    """The last try found the peer not connected: it goes again when the peer is heard from."""


class OutStream:
    """The messages sent to one peer that it has not acknowledged yet."""

    def __init__(self, *, after: int = 0) -> None:
        """``after``: the last number this end's session used for the peer before (numbers are
        never used twice in a session: the peer would take a new message for a copy)."""
        self.next_rseq = after + 1
        self.floor = after
        """Every number at or below it is acknowledged or given up."""
        self.held: OrderedDict[int, Held] = OrderedDict()
        self.acked = 0
        """Messages acknowledged so far."""
        self.abandoned = 0
        """Messages given up unacknowledged (bound exceeded, peer restarted)."""
        self.heard_at = -float("inf")
        """When the peer was last heard from."""

    @property
    def held_bytes(self) -> int:
        return sum(h.nbytes for h in self.held.values())

    def add(self, msg: Message) -> Held:
        """Number ``msg`` and hold it."""
        entry = Held(self.next_rseq, msg)
        self.held[entry.rseq] = entry
        self.next_rseq += 1
        return entry

    def on_ack(self, contig: int, sack: tuple[int, ...]) -> int:
        """The peer holds every number up to ``contig`` and those in ``sack``: release them;
        return how many were released. Numbers never sent are ignored."""
        released = 0
        for rseq in [r for r in self.held if r <= contig or r in sack]:
            del self.held[rseq]
            released += 1
        self.acked += released
        self._raise_floor()
        return released

    def abandon(self, *, keep_bytes: int | None = None, keep: int | None = None) -> int:
        """Give up the oldest held messages until at most ``keep`` remain holding at most
        ``keep_bytes`` (both None: give up all); return how many."""
        dropped = 0
        while self.held and (
            (keep is None and keep_bytes is None)
            or (keep is not None and len(self.held) > keep)
            or (keep_bytes is not None and self.held_bytes > keep_bytes)
        ):
            self.held.popitem(last=False)
            dropped += 1
        self.abandoned += dropped
        self._raise_floor()
        return dropped

    def _raise_floor(self) -> None:
        lowest = next(iter(self.held), self.next_rseq)
        self.floor = max(self.floor, lowest - 1)

    def due(self, now: float, timeout_s: Callable[[Held], float]) -> list[Held]:
        """The oldest held messages that went out (or were tried) at least ``timeout_s(held)``
        ago: up to the first that is not due, so resends keep the order the messages were sent
        in. The timeout doubles per send after the first (see :data:`MAX_BACKOFF`) while the
        peer stays silent; a peer heard from since the last send is there to acknowledge, so
        its timeout is the first one again."""
        out: list[Held] = []
        for h in self.held.values():
            silent = h.sent_at is not None and self.heard_at < h.sent_at
            backoff = 2 ** min(max(h.sends - 1, 0), MAX_BACKOFF) if silent else 1
            if h.sent_at is None or now - h.sent_at < timeout_s(h) * backoff:
                break
            out.append(h)
        return out


class InStream(Generic[T]):
    """What one peer's session has delivered here, in number order: the highest number with none
    missing before it, and what arrived above a gap, held back until the gap fills (as TCP holds
    bytes), so the receiver sees messages in the order they were sent.

    What is held behind a gap is bounded in messages (``max_pending``) and, per offer, in bytes
    (the ``room`` its owner gives). A message that would pass either bound is dropped unheld and
    unacknowledged: its sender resends it once the gap has filled. A gap is never skipped for
    want of room; only the sender's floor (it gave the missing ones up) moves past one."""

    def __init__(self, session: str, *, max_pending: int = 256) -> None:
        self.session = session
        self.contig = 0
        self.pending: dict[int, T] = {}
        """Messages above the gap, by number."""
        self._sizes: dict[int, int] = {}
        self.max_pending = max_pending
        self.duplicates = 0
        """Messages dropped because this end already had them."""
        self.skipped = 0
        """Numbers given up on: at or below the sender's floor."""
        self.refused = 0
        """Messages above a gap dropped unacknowledged because holding them would pass a
        bound (the sender resends them)."""

    @property
    def pending_bytes(self) -> int:
        """The sizes of the messages held above the gap, summed."""
        return sum(self._sizes.values())

    def offer(
        self, rseq: int, floor: int, item: T, *, nbytes: int = 0, room: int | None = None
    ) -> list[T]:
        """Message ``rseq`` (of ``nbytes``) arrived; what to deliver now, in order (empty: a
        copy, held behind a gap, or refused for want of room). ``floor``: the sender holds
        nothing at or below it, so nothing there is still coming and what waits behind it goes.
        ``room``: bytes this stream may hold beyond what it holds now (None: no byte bound)."""
        out: list[T] = []
        if floor > self.contig:
            for number in sorted(r for r in self.pending if r <= floor):
                out.append(self._pop(number))
            self.skipped += floor - self.contig - len(out)
            self.contig = floor
            self._advance(out)
        if rseq <= self.contig or rseq in self.pending:
            self.duplicates += 1
            return out
        if rseq != self.contig + 1 and (
            len(self.pending) >= self.max_pending or (room is not None and nbytes > room)
        ):
            self.refused += 1
            return out
        self.pending[rseq] = item
        self._sizes[rseq] = nbytes
        self._advance(out)
        return out

    def _pop(self, rseq: int) -> T:
        self._sizes.pop(rseq, None)
        return self.pending.pop(rseq)

    def _advance(self, out: list[T]) -> None:
        while self.contig + 1 in self.pending:
            self.contig += 1
            out.append(self._pop(self.contig))

    def ack(self) -> tuple[str, int, tuple[int, ...]]:
        """(the session acknowledged, the highest number with none missing, up to
        :data:`MAX_SACK` of the lowest numbers held above the gap)."""
        return self.session, self.contig, tuple(sorted(self.pending)[:MAX_SACK])


def resend_timeout_s(
    *, rtt_s: float, goodput_bps: float, nbytes: int, ack_delay_s: float, floor_s: float
) -> float:
    """How long to wait for the acknowledgement of a message of ``nbytes`` before sending it
    again: two round trips, its transmission at the measured goodput, and the time the peer may
    take to send anything that carries the acknowledgement (``ack_delay_s``); at least
    ``floor_s``."""
    transmit_s = nbytes * 8.0 / goodput_bps if goodput_bps > 0 else 0.0
    return max(floor_s, 2.0 * rtt_s + transmit_s + ack_delay_s)


__all__ = [
    "MAX_BACKOFF",
    "MAX_SACK",
    "MUST_ARRIVE",
    "Held",
    "InStream",
    "OutStream",
    "resend_timeout_s",
]
