"""Deterministic message loss on a channel's sending side, for fault tests and drills.

A :class:`WireFaults` set on a channel endpoint (``channel.faults``) makes it lose chosen
messages after the socket would have accepted them: a small message is counted as sent and never
put on the wire (as a connection reset loses what ZeroMQ had queued), and every chunk of a chosen
large message is lost the same way, its resends included, so its transfer stalls until the
channel gives it up. Nothing in a running federation sets it.
"""

from __future__ import annotations

import threading
from collections import Counter

from comm.wire.schema import Message


class WireFaults:
    """Which messages to lose: the next ``count`` of a type (optionally to one peer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._small: Counter[tuple[type, bytes | None]] = Counter()
        self._large: Counter[tuple[type, bytes | None]] = Counter()
        self._stalled: set[tuple[bytes, str]] = set()
        self.lost: list[tuple[bytes, str]] = []
        """(peer, message type name) of every message lost so far, in order."""

    def lose_next(self, kind: type, count: int = 1, *, peer: bytes | None = None) -> None:
        """Lose the next ``count`` small messages of ``kind`` (to ``peer``, or to anyone)."""
        with self._lock:
            self._small[(kind, peer)] += count

    def stall_next(self, kind: type, count: int = 1, *, peer: bytes | None = None) -> None:
        """Lose every chunk of the next ``count`` large messages of ``kind``."""
        with self._lock:
            self._large[(kind, peer)] += count

    @staticmethod
    def _take(counter: Counter[tuple[type, bytes | None]], peer: bytes, msg: Message) -> bool:
        for key in ((type(msg), peer), (type(msg), None)):
            if counter[key] > 0:
                counter[key] -= 1
                return True
        return False

    def lose(self, peer: bytes, msg: Message) -> bool:
        """Whether to lose this small message (the channel then does not send it)."""
        with self._lock:
            if not self._take(self._small, peer, msg):
                return False
            self.lost.append((peer, type(msg).__name__))
            return True

    def starting(self, peer: bytes, msg: Message, transfer_id: str) -> None:
        """A large message starts its transfer: note it if its chunks are to be lost."""
        with self._lock:
            if self._take(self._large, peer, msg):
                self._stalled.add((peer, transfer_id))
                self.lost.append((peer, type(msg).__name__))

    def lose_chunk(self, peer: bytes, transfer_id: str) -> bool:
        """Whether to lose this chunk (every chunk of a stalled transfer)."""
        with self._lock:
            return (peer, transfer_id) in self._stalled


__all__ = ["WireFaults"]
