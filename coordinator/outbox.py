"""Durability before announcement: saves on a background writer, and what follows them held back.

The coordinator's loop never waits on the disk. Each save goes to a :class:`StateWriter` and its
ticket becomes the barrier: every action queued after it (a send, a round's result, a status
publication) runs only once that save, and so every earlier one, is durable, in the order queued.
A failed save raises from ``flush`` and stops the coordinator: nothing that followed it is sent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from coordinator.state import GlobalState, StateStore
from coordinator.state_writer import StateWriter


class Outbox:
    """A state writer and the actions waiting on it. ``close`` writes and runs everything."""

    def __init__(self, store: StateStore) -> None:
        self.writer = StateWriter(store)
        self._barrier = 0
        self._queue: deque[tuple[int, Callable[[], None]]] = deque()
        self._running = False

    def persist(self, state: GlobalState, *, counter_only: bool = False) -> None:
        """Queue a save; every action queued from now on waits until it is durable."""
        submit = self.writer.submit_counter if counter_only else self.writer.submit
        self._barrier = submit(state)

    @property
    def durable(self) -> bool:
        """Whether the latest save is durable."""
        return self.writer.durable(self._barrier)

    @property
    def waiting(self) -> bool:
        """Whether actions wait on a save."""
        return bool(self._queue)

    def settled(self) -> bool:
        """Nothing waits: an action may run now. Also while a queued action runs: it was
        written for the state its save made durable, and what it sends must go out in its
        place (queued again, it would land behind the actions of later saves)."""
        return self._running or (not self._queue and self.durable)

    def later(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the latest save is durable (now, if it already is)."""
        if self.settled():
            action()
        else:
            self._queue.append((self._barrier, action))

    def flush(self) -> None:
        """Run, in order, the queued actions whose save is durable (a failed save raises)."""
        while self._queue and self.writer.durable(self._queue[0][0]):
            _, action = self._queue.popleft()
            self._running = True
            try:
                action()
            finally:
                self._running = False

    def drain(self) -> None:
        """Wait for every save, then run everything queued."""
        self.writer.flush()
        self.flush()

    def close(self) -> None:
        self.writer.close()
        self.flush()
