"""One large message on its way out of a channel endpoint (``comm.transport.sending``): where it
goes, its transfer, when it last made progress and how long its next stall may last."""

from __future__ import annotations

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
    """When the acknowledged index last advanced, more credit came, or the receiver answered
    while holding the transfer back (or the transfer began)."""
    waited: bool = False
    """It waited for credit with every chunk acknowledged (the receiver's budget was taken)."""
    resumes_in_a_row: int = 0
    """Resumes since the last progress: each doubles the stall timeout before the next (up to
    ``2**_MAX_BACKOFF`` times), so a receiver slow to acknowledge is not flooded with resends."""
    held: Held | None = None
    """Its entry in the peer's delivery stream, if it must arrive."""


_Pending = tuple[Message, Held | None]
"""A message waiting behind a large one, and its delivery entry if it must arrive."""


_MAX_BACKOFF = 4
