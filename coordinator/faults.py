"""Deterministic fault injection for the coordinator (tests and drills, never on by default).

A :class:`FaultPlan` names protocol points at which the process SIGKILLs itself, so a crash
lands at exactly the same place on every run instead of after a sleep-and-hope, or at which a
message is lost on the wire after the socket accepted it.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

from coordinator.state import GlobalState, StateStore

log = logging.getLogger("crossdc.coordinator")


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Where to crash; 0 disables each point."""

    kill_after_open_round: int = 0
    """SIGKILL right after round N was persisted and announced."""
    kill_after_close_round: int = 0
    """SIGKILL right after round N's result was persisted, before it is announced (a shard of
    several: before it reports the save, so before the commit)."""
    kill_after_saves: int = 0
    """A shard of several: SIGKILL once this process saved the result of the Nth round it
    closed since it started, before it reports the save (so before the commit): a crash point
    between save and commit that needs no round id (a drill's restart does not know which ids
    the rounds after it will get)."""
    kill_before_storing_round: int = 0
    """SIGKILL on the state writer just before it stores round N's id: the round was decided
    and never became durable, so it was never announced either."""
    lose_rerun_plan: int = 0
    """Lose the secure-aggregation re-run plan of round N to its first survivor after the
    socket accepted it (as a reset would); the channel's acknowledged delivery recovers it."""

    def __post_init__(self) -> None:
        for name in (
            "kill_after_open_round",
            "kill_after_close_round",
            "kill_after_saves",
            "kill_before_storing_round",
            "lose_rerun_plan",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"coordinator.faults.{name} must be >= 0")

    def point(self, where: str, round_id: int) -> None:
        target = {
            "open": self.kill_after_open_round,
            "close": self.kill_after_close_round,
            "store": self.kill_before_storing_round,
        }[where]
        if target and target == round_id:
            log.error("[coordinator round=%d] fault injection: SIGKILL at %s", round_id, where)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    def saved(self, count: int, round_id: int) -> None:
        """This process saved its ``count``-th round result (round ``round_id``'s) since it
        started, and has not reported it: the ``kill_after_saves`` point."""
        if self.kill_after_saves and count == self.kill_after_saves:
            log.error(
                "[coordinator round=%d] fault injection: SIGKILL after save %d", round_id, count
            )
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(self, store: StateStore) -> StateStore:
        """``store``, or, with ``kill_before_storing_round`` set, a store that dies at it."""
        return _KillBeforeStoring(store, self) if self.kill_before_storing_round else store


class _KillBeforeStoring:
    """A state store whose id-only save of round ``plan.kill_before_storing_round`` SIGKILLs
    the process before anything is written (the save that makes an opened round's id durable)."""

    def __init__(self, store: StateStore, plan: FaultPlan) -> None:
        self.store, self.plan = store, plan

    def load(self) -> GlobalState | None:
        return self.store.load()

    def save(self, state: GlobalState) -> None:
        self.store.save(state)

    def save_counter(self, state: GlobalState) -> None:
        self.plan.point("store", state.round_counter)
        self.store.save_counter(state)

    def roll_back(self, version: int) -> None:
        self.store.roll_back(version)  # type: ignore[attr-defined]
