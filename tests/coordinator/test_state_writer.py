"""StateWriter: saves on a background thread, in order, durable only once the store returned.

Contract suite over both stores behind a gate the test opens, so that every "not yet durable"
is checked while the save is provably still inside the store (no sleeps, no timing).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.file_store import FileStateStore
from coordinator.state import GlobalState, MemoryStateStore, StateStore
from coordinator.state_writer import StateWriteError, StateWriter

pytestmark = pytest.mark.timeout(30)

WAIT_S = 20.0
"""Upper bound for a wait that must succeed (a hang fails the test instead of blocking it)."""


def make_state(version: int, rounds: int | None = None) -> GlobalState:
    p = {"w": np.full(8, float(version), np.float32)}
    z = {"w": np.zeros(8, np.float32)}
    n = version if rounds is None else rounds
    history = tuple({"round_id": r, "global_version": r} for r in range(1, n + 1))
    vals = {v: 5.0 - v for v in range(version + 1)}
    return GlobalState(p, z, z, version, version, "fp", history, vals)


class GatedStore:
    """A store whose saves wait for ``gate`` (once ``hold`` is set) and are recorded in order."""

    def __init__(self, inner: StateStore, *, fail_on: int | None = None) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        """Set when a save is inside the store (waiting at the gate)."""
        self.done: list[tuple[str, int, int]] = []
        self.fail_on = fail_on
        self.thread_names: set[str] = set()

    def hold(self) -> None:
        self.gate.clear()
        self.entered.clear()

    def _call(self, kind: str, state: GlobalState) -> None:
        self.thread_names.add(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        if self.fail_on is not None and len(self.done) + 1 == self.fail_on:
            raise OSError(28, "No space left on device")
        if kind == "save":
            self.inner.save(state)
        else:
            self.inner.save_counter(state)
        self.done.append((kind, state.global_version, state.round_counter))

    def load(self) -> GlobalState | None:
        return self.inner.load()

    def save(self, state: GlobalState) -> None:
        self._call("save", state)

    def save_counter(self, state: GlobalState) -> None:
        self._call("counter", state)


@pytest.fixture(params=["memory", "file"])
def inner(request: pytest.FixtureRequest, tmp_path: Path) -> StateStore:
    return MemoryStateStore() if request.param == "memory" else FileStateStore(tmp_path / "state")


def test_saves_run_in_order_off_the_calling_thread(inner: StateStore) -> None:
    store = GatedStore(inner)
    writer = StateWriter(store)
    try:
        store.hold()
        t1 = writer.submit(make_state(1))
        assert store.entered.wait(WAIT_S)  # the first save is inside the store, held
        t2 = writer.submit_counter(replace(make_state(1), round_counter=2))
        t3 = writer.submit(replace(make_state(2), round_counter=2))
        t4 = writer.submit_counter(replace(make_state(2), round_counter=3))
        assert t1 < t2 < t3 < t4
        assert not any(writer.durable(t) for t in (t1, t2, t3, t4))
        assert writer.pending == 4 and writer.durable_ticket == 0
        store.gate.set()
        assert writer.wait(t4, timeout=WAIT_S)
        assert all(writer.durable(t) for t in (t1, t2, t3, t4))
        assert writer.pending == 0 and writer.durable_ticket == t4
    finally:
        writer.close(timeout=WAIT_S)
    assert store.done == [("save", 1, 1), ("counter", 1, 2), ("save", 2, 2), ("counter", 2, 3)]
    assert threading.current_thread().name not in store.thread_names
    got = inner.load()
    assert got is not None and (got.global_version, got.round_counter) == (2, 3)
    assert got.history == make_state(2).history


def test_durable_only_after_the_store_returned(inner: StateStore) -> None:
    store = GatedStore(inner)
    with StateWriter(store) as writer:
        assert writer.durable(0), "ticket 0: nothing submitted, trivially durable"
        store.hold()
        ticket = writer.submit(make_state(1))
        assert store.entered.wait(WAIT_S)
        assert not writer.durable(ticket)
        assert not writer.wait(ticket, timeout=0.01)  # still held inside the store
        assert inner.load() is None
        store.gate.set()
        assert writer.wait(ticket, timeout=WAIT_S) and writer.durable(ticket)
        got = inner.load()
        assert got is not None and got.global_version == 1


def test_close_flushes_everything_submitted(inner: StateStore) -> None:
    store = GatedStore(inner)
    writer = StateWriter(store)
    store.hold()
    writer.submit(make_state(0))
    for v in range(1, 11):
        writer.submit(make_state(v))
        writer.submit_counter(replace(make_state(v), round_counter=v + 1))
    store.gate.set()
    writer.close(timeout=WAIT_S)
    assert len(store.done) == 21 and writer.pending == 0
    got = inner.load()
    assert got is not None and (got.global_version, got.round_counter) == (10, 11)
    assert len(got.history) == 10 and got.val_losses == make_state(10).val_losses
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(make_state(11))
    writer.close()  # closing twice is harmless


def test_flush_waits_for_everything_so_far(inner: StateStore) -> None:
    store = GatedStore(inner)
    with StateWriter(store) as writer:
        store.hold()
        writer.submit(make_state(1))
        writer.submit(make_state(2))
        assert store.entered.wait(WAIT_S)
        assert not writer.flush(timeout=0.01)
        store.gate.set()
        assert writer.flush(timeout=WAIT_S)
        assert [d[1] for d in store.done] == [1, 2]


def test_a_failed_save_is_reported_and_nothing_after_it_runs(inner: StateStore) -> None:
    store = GatedStore(inner, fail_on=2)
    writer = StateWriter(store)
    store.hold()
    t1 = writer.submit(make_state(1))
    t2 = writer.submit(make_state(2))
    t3 = writer.submit_counter(replace(make_state(2), round_counter=3))
    store.gate.set()
    with pytest.raises(StateWriteError) as info:
        writer.wait(t2, timeout=WAIT_S)
    assert isinstance(info.value.__cause__, OSError) and info.value.ticket == t2
    assert writer.durable(t1)
    with pytest.raises(StateWriteError):
        writer.durable(t3)
    with pytest.raises(StateWriteError):
        writer.submit(make_state(3))
    with pytest.raises(StateWriteError):
        writer.close(timeout=WAIT_S)
    assert store.done == [("save", 1, 1)]
    got = inner.load()
    assert got is not None and got.global_version == 1


def test_a_state_is_snapshotted_at_submit(inner: StateStore) -> None:
    # The coordinator amends the latest round's entry (and may build new val_losses) after it
    # hands the state over; the save must store what was submitted, never a half-changed dict.
    store = GatedStore(inner)
    with StateWriter(store) as writer:
        s = make_state(1)
        store.hold()
        writer.submit(make_state(0))
        assert store.entered.wait(WAIT_S)
        t1 = writer.submit(s)
        last: dict[str, Any] = s.history[-1]
        last["broadcast_bytes"] = 528
        s.val_losses[7] = 1.0
        store.gate.set()
        assert writer.wait(t1, timeout=WAIT_S)
        got = inner.load()
        assert got is not None
        assert got.history == ({"round_id": 1, "global_version": 1},)
        assert 7 not in got.val_losses
        # The amendment is stored with the next save, as with a synchronous store.
        t2 = writer.submit_counter(replace(s, round_counter=2))
        assert writer.wait(t2, timeout=WAIT_S)
        got = inner.load()
        assert got is not None and got.history[-1]["broadcast_bytes"] == 528


def test_tickets_are_checked() -> None:
    with StateWriter(MemoryStateStore()) as writer:
        with pytest.raises(ValueError, match="ticket"):
            writer.durable(1)
        with pytest.raises(ValueError, match="ticket"):
            writer.wait(-1)
