"""Deterministic fault injection for the coordinator (tests and drills, never on by default).

A :class:`FaultPlan` names protocol points at which the process SIGKILLs itself, so a crash
lands at exactly the same place on every run instead of after a sleep-and-hope.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

log = logging.getLogger("crossdc.coordinator")


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Where to crash; 0 disables each point."""

    kill_after_open_round: int = 0
    """SIGKILL right after round N was persisted and announced."""
    kill_after_close_round: int = 0
    """SIGKILL right after round N's result was persisted, before it is announced."""

    def __post_init__(self) -> None:
        if self.kill_after_open_round < 0 or self.kill_after_close_round < 0:
            raise ValueError("coordinator.faults.kill_after_* must be >= 0")

    def point(self, where: str, round_id: int) -> None:
        target = {"open": self.kill_after_open_round, "close": self.kill_after_close_round}[where]
        if target and target == round_id:
            log.error("[coordinator round=%d] fault injection: SIGKILL after %s", round_id, where)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
