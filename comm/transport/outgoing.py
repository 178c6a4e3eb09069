"""What a channel endpoint (``comm.transport.sending``) has on its way to one peer: the large
message in transfer (where it goes, its transfer, when it last made progress, when to give it
up) and the messages waiting behind it (with what they cost in bytes)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from comm.transport.reliable import Held
from comm.transport.sender import TransferSender
from comm.wire.schema import Message


@dataclass
class _Outgoing:
    """A large message being sent: where to, its transfer state, when it last made progress."""

    peer: bytes
    prefix: list[bytes]
    """The routing frames that address the peer."""
    tx: TransferSender
    progress_at: float
    """When the acknowledged index last advanced or the receiver admitted the transfer (or the
    transfer began). More credit without an advance, and a receiver's keepalives while it holds
    the transfer back, are not progress."""
    waited: bool = False
    """It waited for credit with every chunk acknowledged (the receiver's budget was taken)."""
    resumes_in_a_row: int = 0
    """Resumes since the last progress: each doubles the stall timeout before the next (up to
    ``2**_MAX_BACKOFF`` times), so a receiver slow to acknowledge is not flooded with resends."""
    held: Held | None = None
    """Its entry in the peer's delivery stream, if it must arrive."""

    def give_up_reason(
        self, now: float, *, base_s: float, send_timeout_s: float, credit_wait_s: float
    ) -> str | None:
        """Why to drop this transfer now (None: keep it). ``base_s``: its stall timeout.

        It is dropped once nothing advanced for ``max(send_timeout_s, 3 x base_s)``, whatever
        acknowledgements came meanwhile, except while the receiver holds it back for its
        receive budget (every chunk sent acknowledged, never granted beyond the initial
        credit): then the receiver's keepalives keep it for up to ``credit_wait_s`` since the
        last advance, and without them it goes after the send timeout since the last one.
        So nothing a peer answers keeps a transfer, and what waits behind it, for longer than
        ``max(send_timeout_s, 3 x base_s, credit_wait_s)`` without a chunk moving on.
        """
        tx = self.tx
        limit_s = max(send_timeout_s, 3 * base_s)
        idle_s = now - self.progress_at
        if tx.waiting_for_credit and not tx.admitted:
            heard_at = self.progress_at if tx.last_progress_at is None else tx.last_progress_at
            if now - heard_at >= limit_s:
                return f"held back without credit and no keepalive for {now - heard_at:.1f} s"
            if idle_s >= max(limit_s, credit_wait_s):
                return f"held back without credit for {idle_s:.1f} s"
            return None
        if idle_s >= limit_s:
            return f"no progress for {idle_s:.1f} s"
        return None


_Pending = tuple[Message, Held | None]
"""A message waiting behind a large one, and its delivery entry if it must arrive."""


class _Queue:
    """The messages waiting for one peer behind a large one, in the order they were sent.

    A message that must arrive is charged by its delivery entry (``Held.nbytes``, counted in
    the peer's delivery stream); any other is charged here (:attr:`unheld_bytes`), so what
    waits is bounded in bytes with what is held (``ChannelConfig.max_unacked_bytes``).
    """

    def __init__(self) -> None:
        self._items: deque[tuple[Message, Held | None, int]] = deque()
        self.unheld_bytes = 0
        """The sizes of the waiting messages that are not held for delivery, summed."""

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[_Pending]:
        return ((msg, held) for msg, held, _ in self._items)

    def append(self, msg: Message, held: Held | None, nbytes: int = 0) -> None:
        """Put ``msg`` last; ``nbytes``: its size, charged here if it is not held."""
        charged = nbytes if held is None else 0
        self._items.append((msg, held, charged))
        self.unheld_bytes += charged

    def first(self) -> _Pending:
        msg, held, _ = self._items[0]
        return msg, held

    def popleft(self) -> None:
        _, _, charged = self._items.popleft()
        self.unheld_bytes -= charged

    def discard_given_up(self, still_held: dict[int, Held]) -> int:
        """Remove the messages whose delivery entry was given up (not in ``still_held``): they
        must not be sent. Return how many."""
        before = len(self._items)
        self._items = deque(
            item for item in self._items if item[1] is None or item[1].rseq in still_held
        )
        return before - len(self._items)


_MAX_BACKOFF = 4
