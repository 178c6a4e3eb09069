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

from crossdc.bench.chaos_fed import Federation, Role

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
pause_site: SIGSTOP, SIGCONT a few seconds later (a straggler). With several shards a
coordinator fault hits one shard, and cut_link and partition_site cut every link of the site."""

SHARD_KINDS = ("kill_shard_at_save", "cut_shard_link")
"""Drawn too with several shards. kill_shard_at_save: SIGKILL of a shard now, and its next
incarnation kills itself once it saved the first round it closes, before that round is
committed (``[coordinator.faults] kill_after_saves = 1``: shard 0 before its commit record, any
other shard before its report); cut_shard_link: a site's link to one shard only down for a few
seconds (the site half-way through a round: one part of its update in, the other not)."""

CUT_SECONDS = (2.0, 5.0)
PAUSE_SECONDS = (3.0, 8.0)
PARTITION_EXTRA_S = 5.0
"""A partition lasts the coordinator's site timeout plus this."""


def kinds(shards: int = 1) -> tuple[str, ...]:
    """The fault kinds drawn for a coordinator of ``shards`` processes."""
    return KINDS if shards == 1 else KINDS + SHARD_KINDS


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    target: str
    duration_s: float
    shard: int | None = None
    """The shard a coordinator fault or a one-shard cut hits (None with one shard)."""


def draw_fault(
    rng: random.Random, index: int, sites: list[str], site_timeout_s: float, shards: int = 1
) -> Fault:
    """The ``index``-th fault; always consumes the same number of draws from ``rng`` (one more
    with several shards: the shard)."""
    kind = rng.choice(kinds(shards))
    site = rng.choice(sites)
    span = rng.random()
    shard = rng.randrange(shards) if shards > 1 else None
    on_coordinator = kind.endswith("coordinator") or kind == "kill_shard_at_save"
    if not on_coordinator:
        target = site
    else:
        target = "coordinator" if shard is None else f"coordinator-{shard}"
    if kind in ("cut_link", "cut_shard_link"):
        duration = CUT_SECONDS[0] + span * (CUT_SECONDS[1] - CUT_SECONDS[0])
    elif kind == "pause_site":
        duration = PAUSE_SECONDS[0] + span * (PAUSE_SECONDS[1] - PAUSE_SECONDS[0])
    elif kind == "partition_site":
        duration = site_timeout_s + PARTITION_EXTRA_S
    else:
        duration = 0.0
    on_shard = shard is not None and (on_coordinator or kind == "cut_shard_link")
    return Fault(index, kind, target, round(duration, 2), shard if on_shard else None)


@dataclass
class Injector:
    """Applies faults and undoes the timed ones when they are due (from :meth:`tick`)."""

    fed: Federation
    seed: int
    rng: random.Random = field(init=False)
    timers: list[tuple[float, str, Callable[[], None]]] = field(default_factory=list)
    applied: list[dict[str, object]] = field(default_factory=list)
    skipped: list[dict[str, object]] = field(default_factory=list)
    armed: list[str] = field(default_factory=list)
    """The role of every crash point armed by kill_shard_at_save."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def inject_next(self) -> Fault:
        fault = draw_fault(
            self.rng,
            len(self.applied) + len(self.skipped),
            self.fed.site_ids,
            self.fed.spec.site_timeout_s,
            self.fed.spec.shards,
        )
        self.inject(fault)
        return fault

    def inject(self, fault: Fault) -> bool:
        """Apply ``fault`` now (drawn, or chosen by a test); recorded as applied or skipped."""
        ok = self._apply(fault)
        record: dict[str, object] = {
            "t": round(self.fed.now(), 3),
            "kind": fault.kind,
            "target": fault.target,
            "duration_s": fault.duration_s,
        }
        if fault.shard is not None:
            record["shard"] = fault.shard
        (self.applied if ok else self.skipped).append(record)
        self.fed.event("fault" if ok else "fault_skipped", **record)
        return ok

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
        if fault.kind == "kill_shard_at_save":
            return self._kill_at_save(role)
        if fault.kind in ("cut_link", "partition_site", "cut_shard_link"):
            names = fed.links_of[fault.target]
            if fault.shard is not None:
                names = [names[fault.shard]]
            if any(fed.link_down[n] for n in names):
                return False
            for name in names:
                self._link(name, down=True)
                self._after(fault.duration_s, f"link up {name}", self._link_up(name))
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

    def _kill_at_save(self, role: Role) -> bool:
        """SIGKILL ``role`` (a shard) and arm its next incarnation to kill itself once it saved
        the first round it closes, before that round is committed."""
        if not role.alive:
            return False
        self.fed.arm(role, {"kill_after_saves": 1})
        role.exit_expected = True
        self.fed.signal(role, signal.SIGKILL)
        self.armed.append(role.name)
        return True

    def _link(self, name: str, *, down: bool) -> None:
        """Link ``name`` (``Federation.links_of``) down or up; events name the site (and the
        shard with several)."""
        self.fed.run.links[name].set_down(down)
        self.fed.link_down[name] = down
        site, _, shard = name.partition("@")
        where = {"shard": int(shard)} if shard else {}
        self.fed.event("link_down" if down else "link_up", role=site, **where)

    def _link_up(self, name: str) -> Callable[[], None]:
        return lambda: self._link(name, down=False)

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
        counts = dict.fromkeys(kinds(self.fed.spec.shards), 0)
        for record in self.applied:
            counts[str(record["kind"])] += 1
        return counts
