"""``StateWriter``: runs a ``StateStore``'s saves on a background thread, in order, and says
which of them are durable."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace
from types import TracebackType
from typing import Literal

from coordinator.state import GlobalState, StateStore


class StateWriteError(RuntimeError):
    """A background save failed: its state and everything submitted after it are not durable."""

    def __init__(self, ticket: int, cause: BaseException) -> None:
        super().__init__(f"state save #{ticket} failed: {cause!r}")
        self.ticket = ticket


def _snapshot(state: GlobalState) -> GlobalState:
    """What a background save may read while the caller goes on: the latest round's entry and
    ``val_losses`` copied (the coordinator amends the one and rebuilds the other); the arrays
    and older rounds are shared, so the caller must not change them in place before the save is
    durable."""
    history = state.history
    if history:
        history = (*history[:-1], dict(history[-1]))
    return replace(
        state,
        history=history,
        val_losses=dict(state.val_losses),
        val_metrics=dict(state.val_metrics),
    )


class StateWriter:
    """Runs a ``StateStore``'s saves on a background thread, in the order they were submitted.

    ``submit(state)`` queues ``store.save(state)`` and ``submit_counter(state)`` queues
    ``store.save_counter(state)``; each returns a ticket (1, 2, 3, ...). ``durable(ticket)``
    says, without blocking, whether that save (and so every earlier one) has returned from the
    store; ``wait(ticket)`` blocks until it has. A failed save stops the writer: ``durable``,
    ``wait``, ``submit`` and ``close`` then raise ``StateWriteError`` for it and everything
    after it, which is never attempted. ``close()`` writes everything submitted, then stops.

    A state is snapshotted at submit (``_snapshot``); its arrays are not copied, so they must
    not be changed in place until the save is durable (a coordinator's close, which overwrites
    them, first waits for every save submitted: ``GlobalModel.changing``). A coordinator
    announces a global version once ``durable`` says its save's ticket is, and keeps every save
    on one writer, since a direct store call could overtake the queue.
    """

    def __init__(self, store: StateStore, *, name: str = "state-writer") -> None:
        self.store = store
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, Literal["save", "counter"], GlobalState]] = deque()
        self._submitted = 0
        self._durable = 0
        self._error: StateWriteError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- the caller's side -----------------------------------------------------------------

    def submit(self, state: GlobalState) -> int:
        """Queue ``store.save(state)``; returns its ticket."""
        return self._submit("save", state)

    def submit_counter(self, state: GlobalState) -> int:
        """Queue ``store.save_counter(state)``; returns its ticket."""
        return self._submit("counter", state)

    def _submit(self, kind: Literal["save", "counter"], state: GlobalState) -> int:
        snapshot = _snapshot(state)
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise RuntimeError("StateWriter is closed")
            self._submitted += 1
            self._queue.append((self._submitted, kind, snapshot))
            self._cond.notify_all()
            return self._submitted

    def _check(self, ticket: int) -> bool:
        """Whether ``ticket`` is durable (the lock held); raises if it never will be."""
        if not 0 <= ticket <= self._submitted:
            raise ValueError(f"no such ticket: {ticket} (submitted {self._submitted})")
        if ticket <= self._durable:
            return True
        if self._error is not None:
            raise self._error
        return False

    def durable(self, ticket: int) -> bool:
        """Whether the save with ``ticket`` has returned from the store (ticket 0: always)."""
        with self._cond:
            return self._check(ticket)

    def wait(self, ticket: int, timeout: float | None = None) -> bool:
        """Block until ``ticket`` is durable (True) or ``timeout`` seconds pass (False)."""
        with self._cond:
            self._check(ticket)  # a ticket never issued would never come
            self._cond.wait_for(lambda: self._durable >= ticket or self._error is not None, timeout)
            return self._check(ticket)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until everything submitted so far is durable (True) or ``timeout`` passes."""
        with self._cond:
            last = self._submitted
        return self.wait(last, timeout)

    @property
    def durable_ticket(self) -> int:
        """The highest ticket that is durable (0: none yet)."""
        with self._cond:
            return self._durable

    @property
    def pending(self) -> int:
        """Saves submitted and not yet durable."""
        with self._cond:
            return self._submitted - self._durable

    def close(self, timeout: float | None = None) -> None:
        """Write everything submitted, then stop the thread; raises ``StateWriteError`` if a
        save failed. Further submits raise ``RuntimeError``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._thread.is_alive():
                raise TimeoutError(f"{self.pending} state saves still pending after {timeout}s")

    def __enter__(self) -> StateWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- the writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return  # closed and drained
                ticket, kind, state = self._queue[0]
            try:
                if kind == "save":
                    self.store.save(state)
                else:
                    self.store.save_counter(state)
            except BaseException as exc:  # reported to every waiter and submitter
                error = StateWriteError(ticket, exc)
                error.__cause__ = exc
                with self._cond:
                    self._error = error
                    self._queue.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._queue.popleft()
                self._durable = ticket
                self._cond.notify_all()
