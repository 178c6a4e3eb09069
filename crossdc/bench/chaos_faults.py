"""Faults for ``crossdc bench chaos``: chosen by a seeded RNG, applied to a :class:`Federation`.

The choice of every fault (kind, target, duration) depends only on the seed and its index, never
on the federation's state, so two runs with the same seed draw the same sequence. Whether a
fault could be applied does depend on the state (a site that is still restarting cannot be
killed); such a fault is recorded as skipped.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from crossdc.bench.chaos_fed import Federation

KINDS = (
    "kill_site",
    "kill_coordinator",
    "term_site",
    "term_coordinator",
    "cut_link",
    "partition_site",
    "pause_site",
)
"""kill_*: SIGKILL; term_*: SIGTERM, then a start (a graceful restart); cut_link: a site's link
down for a few seconds; partition_site: down for longer than the coordinator's site timeout;
pause_site: SIGSTOP, SIGCONT a few seconds later (a straggler)."""

CUT_SECONDS = (2.0, 5.0)
PAUSE_SECONDS = (3.0, 8.0)
PARTITION_EXTRA_S = 5.0
"""A partition lasts the coordinator's site timeout plus this."""


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    target: str
    duration_s: float


def draw_fault(rng: random.Random, index: int, sites: list[str], site_timeout_s: float) -> Fault:
    """The ``index``-th fault; always consumes the same number of draws from ``rng``."""
    kind = rng.choice(KINDS)
    site = rng.choice(sites)
    span = rng.random()
    target = "coordinator" if kind.endswith("coordinator") else site
    if kind == "cut_link":
        duration = CUT_SECONDS[0] + span * (CUT_SECONDS[1] - CUT_SECONDS[0])
    elif kind == "pause_site":
        duration = PAUSE_SECONDS[0] + span * (PAUSE_SECONDS[1] - PAUSE_SECONDS[0])
    elif kind == "partition_site":
        duration = site_timeout_s + PARTITION_EXTRA_S
    else:
        duration = 0.0
    return Fault(index, kind, target, round(duration, 2))


@dataclass
class Injector:
    """Applies faults and undoes the timed ones when they are due (from :meth:`tick`)."""

    fed: Federation
    seed: int
    rng: random.Random = field(init=False)
    timers: list[tuple[float, str, Callable[[], None]]] = field(default_factory=list)
    applied: list[dict[str, object]] = field(default_factory=list)
    skipped: list[dict[str, object]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def inject_next(self) -> Fault:
        fault = draw_fault(
            self.rng,
            len(self.applied) + len(self.skipped),
            self.fed.site_ids,
            self.fed.spec.site_timeout_s,
        )
        ok = self._apply(fault)
        record = {
            "t": round(self.fed.now(), 3),
            "kind": fault.kind,
            "target": fault.target,
            "duration_s": fault.duration_s,
        }
        (self.applied if ok else self.skipped).append(record)
        self.fed.event("fault" if ok else "fault_skipped", **record)
        return fault

    def _apply(self, fault: Fault) -> bool:
        fed = self.fed
        role = fed.roles[fault.target]
        if fault.kind in ("kill_site", "kill_coordinator"):
            role.exit_expected = role.exit_expected or role.alive
            return fed.signal(role, signal.SIGKILL)
        if fault.kind in ("term_site", "term_coordinator"):
            if not fed.signal(role, signal.SIGTERM):
                return False
            role.restart_wanted = role.exit_expected = True
            if role.paused:
                fed.signal(role, signal.SIGCONT)  # a stopped process handles SIGTERM on continue
            return True
        if fault.kind in ("cut_link", "partition_site"):
            if fed.link_down[fault.target]:
                return False
            self._link(fault.target, down=True)
            self._after(fault.duration_s, f"link up {fault.target}", self._link_up(fault.target))
            return True
        if fault.kind == "pause_site":
            if role.paused or not fed.signal(role, signal.SIGSTOP):
                return False
            proc = role.proc

            def resume() -> None:
                if role.proc is proc and role.paused:
                    fed.signal(role, signal.SIGCONT)
                    fed.event("resume", role=role.name)

            self._after(fault.duration_s, f"continue {fault.target}", resume)
            return True
        raise ValueError(f"unknown fault kind {fault.kind!r}")

    def _link(self, site_id: str, *, down: bool) -> None:
        self.fed.run.links[site_id].set_down(down)
        self.fed.link_down[site_id] = down
        self.fed.event("link_down" if down else "link_up", role=site_id)

    def _link_up(self, site_id: str) -> Callable[[], None]:
        return lambda: self._link(site_id, down=False)

    def _after(self, seconds: float, label: str, fn: Callable[[], None]) -> None:
        self.timers.append((self.fed.now() + seconds, label, fn))

    def tick(self) -> None:
        """Run the undo actions that are due."""
        now = self.fed.now()
        due = [t for t in self.timers if t[0] <= now]
        self.timers = [t for t in self.timers if t[0] > now]
        for _, _, fn in sorted(due, key=lambda t: t[0]):
            fn()

    def settle(self) -> None:
        """Undo every timed fault now (links up, paused sites continued)."""
        pending, self.timers = self.timers, []
        for _, _, fn in sorted(pending, key=lambda t: t[0]):
            fn()

    def kind_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(KINDS, 0)
        for record in self.applied:
            counts[str(record["kind"])] += 1
        return counts
