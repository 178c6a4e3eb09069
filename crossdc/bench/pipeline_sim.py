"""Discrete-event simulation of one step of a pipeline schedule, in the order torch runs it.

An ``Order`` gives each rank of one replica its compute actions (``Action``), run one at a time
in list order; ``executed_order`` gives the order torch's schedules run, ``simulate`` times it
under the model in docs/pipelines.md ("Measured against the simulator").
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["F", "B", "I", "W"]
KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")


@dataclass(frozen=True, order=True)
class Action:
    """One compute action of a schedule, written as torch writes it (``1F0``: stage 1's forward
    of micro-batch 0)."""

    stage: int
    kind: Kind
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and microbatch must be >= 0 in {self!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


Order = Mapping[int, Sequence[Action]]
"""``order[rank]``: the actions that rank runs, in order."""

Durations = Mapping[tuple[int, str], float] | Mapping[Action, float]
"""Seconds one action of ``(stage, kind)`` takes, or each ``Action`` its own (a measured step
replayed)."""


@dataclass(frozen=True, kw_only=True)
class ActionTiming:
    """When one action ran on one rank."""

    rank: int
    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Outcome of simulating one step."""

    step_time_s: float
    """Time from the step's start until the last action on any rank ends."""
    busy_s: tuple[float, ...]
    """Per rank: seconds spent running actions."""
    bubble_fraction: float
    """Idle share of all ranks' time: ``1 - sum(busy_s) / (num_ranks * step_time_s)``."""
    timeline: tuple[tuple[ActionTiming, ...], ...]
    """Per rank: each action's start and end, in the rank's order."""


def single_stage_order(
    schedule: str, num_ranks: int, num_microbatches: int
) -> dict[int, list[Action]]:
    """The order torch's ``ScheduleGPipe`` (``"gpipe"``) or ``Schedule1F1B`` (``"1f1b"``) runs:
    one stage per rank. GPipe: every forward, then every backward in micro-batch order. 1F1B:
    stage s runs ``min(m, p - s)`` forwards, then alternates one backward and one forward (1B1F)
    until the forwards run out, then the remaining backwards."""
    if num_ranks < 1 or num_microbatches < 1:
        raise ValueError(
            f"num_ranks and num_microbatches must be >= 1, got {num_ranks}, {num_microbatches}"
        )
    m = num_microbatches
    order: dict[int, list[Action]] = {}
    for s in range(num_ranks):
        forwards = [Action(s, "F", i) for i in range(m)]
        backwards = [Action(s, "B", i) for i in range(m)]
        if schedule == "gpipe":
            order[s] = forwards + backwards
        elif schedule == "1f1b":
            warmup = min(m, num_ranks - s)
            ops = forwards[:warmup]
            for k in range(m):
                ops.append(backwards[k])
                if warmup + k < m:
                    ops.append(forwards[warmup + k])
            order[s] = ops
        else:
            raise ValueError(f"{schedule!r} is not a single-stage schedule (gpipe, 1f1b)")
    return order


_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")


def executed_order(
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    pipeline_order: Mapping[int, Sequence[str]] | None = None,
) -> dict[int, list[Action]]:
    """The compute actions each rank runs under torch's ``schedule``.

    ``gpipe`` and ``1f1b`` follow ``single_stage_order``. The schedules with several stages per
    rank run their ``pipeline_order`` attribute, which must be given, as torch writes its
    actions (``"1F0"``; ``""`` for an idle slot): its compute actions are kept, idle slots,
    communication and gradient reductions dropped.
    """
    if schedule in ("gpipe", "1f1b"):
        return single_stage_order(schedule, num_ranks, num_microbatches)
    if pipeline_order is None:
        raise ValueError(f"schedule {schedule!r} needs torch's pipeline_order")
    order: dict[int, list[Action]] = {}
    for rank in range(num_ranks):
        matches = (_ACTION.fullmatch(text) for text in pipeline_order[rank])
        order[rank] = [
            Action(int(m[1]), m[2], int(m[3]))  # type: ignore[arg-type]
            for m in matches
            if m is not None
        ]
    validate_order(order)
    return order


def validate_order(order: Order) -> tuple[dict[int, int], int]:
    """Check that ``order`` is a schedule; return (each stage's rank, the micro-batch count).

    Every stage lives on one rank; every stage runs F of every micro-batch once and either B or
    I then W once, after its F on that rank. Raises ``ValueError`` naming what is wrong.
    """
    if not order:
        raise ValueError("the schedule has no ranks")
    rank_of: dict[int, int] = {}
    seen: set[Action] = set()
    for rank, actions in order.items():
        for pos, a in enumerate(actions):
            if not isinstance(a, Action):
                raise ValueError(f"rank {rank} action {pos}: expected an Action, got {a!r}")
            if rank_of.setdefault(a.stage, rank) != rank:
                raise ValueError(f"stage {a.stage} runs on ranks {rank_of[a.stage]} and {rank}")
            if a in seen:
                raise ValueError(f"rank {rank} action {pos}: {a} appears twice")
            needs = {"B": "F", "I": "F", "W": "I"}.get(a.kind)
            if needs is not None and Action(a.stage, needs, a.microbatch) not in seen:  # type: ignore[arg-type]
                raise ValueError(f"rank {rank} action {pos}: {a} comes before its {needs}")
            seen.add(a)
    stages = sorted(rank_of)
    if stages != list(range(len(stages))):
        raise ValueError(f"stages must be 0..{len(stages) - 1}, got {stages}")
    m = sum(1 for a in seen if a.stage == 0 and a.kind == "F")
    if m == 0:
        raise ValueError("stage 0 runs no forward")
    for s in stages:
        for i in range(m):
            f, b, i_, w = (Action(s, k, i) in seen for k in KINDS)
            if not (f and (b, i_, w) in ((True, False, False), (False, True, True))):
                raise ValueError(
                    f"stage {s} does not run micro-batch {i} exactly once (F, B or I+W)"
                )
    if any(a.microbatch >= m for a in seen):  # duplicates were refused above
        raise ValueError(f"actions outside micro-batches 0..{m - 1}")
    return rank_of, m


def simulate(order: Order, durations: Durations, transfer_s: float = 0.0) -> SimResult:
    """Simulate one step of ``order`` with ``durations`` (for every action of the order: its
    ``(stage, kind)``'s, or its own) and ``transfer_s`` per hand-off between ranks. Raises
    ``ValueError`` for an invalid order, a missing or negative duration, and an order that
    deadlocks."""
    rank_of, _ = validate_order(order)
    table: dict[Any, float] = dict(durations)
    seconds: dict[Action, float] = {}
    for a in (a for actions in order.values() for a in actions):
        value = table.get(a, table.get((a.stage, a.kind)))
        if value is None or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"the duration of {a} must be finite and >= 0, got {value!r}")
        seconds[a] = value
    if not (math.isfinite(transfer_s) and transfer_s >= 0):
        raise ValueError(f"transfer_s must be finite and >= 0, got {transfer_s!r}")
    sim = _Simulation(order, rank_of, seconds, transfer_s)
    sim.run()
    return sim.result()


class _Simulation:
    """The event loop of one step: which action each rank runs next and when each ended."""

    def __init__(
        self,
        order: Order,
        rank_of: Mapping[int, int],
        durations: Mapping[Action, float],
        transfer_s: float,
    ) -> None:
        self.ranks = sorted(order)
        self.order = order
        self.rank_of = rank_of
        self.last_stage = max(rank_of)
        self.durations = durations
        self.transfer_s = transfer_s
        self.ended: dict[Action, float] = {}
        self.pos = dict.fromkeys(self.ranks, 0)
        self.free_at = dict.fromkeys(self.ranks, 0.0)
        self.running = dict.fromkeys(self.ranks, False)
        self.timeline: dict[int, list[ActionTiming]] = {r: [] for r in self.ranks}
        self.events: list[tuple[float, int, int]] = []  # (end, tie-break, rank)
        self.seq = 0

    def inputs(self, a: Action) -> list[Action]:
        """The actions on other stages one of which ``a`` takes its input from."""
        if a.kind == "F" and a.stage > 0:
            return [Action(a.stage - 1, "F", a.microbatch)]
        if a.kind in ("B", "I") and a.stage < self.last_stage:
            return [Action(a.stage + 1, k, a.microbatch) for k in ("B", "I")]
        return []

    def try_start(self, rank: int) -> None:
        actions = self.order[rank]
        if self.running[rank] or self.pos[rank] == len(actions):
            return
        a = actions[self.pos[rank]]
        start = self.free_at[rank]
        producers = self.inputs(a)
        if producers:
            done = [p for p in producers if p in self.ended]
            if not done:
                return  # tried again when the producer ends
            hop = self.transfer_s if self.rank_of[done[0].stage] != rank else 0.0
            start = max(start, self.ended[done[0]] + hop)
        end = start + self.durations[a]
        self.running[rank] = True
        self.timeline[rank].append(ActionTiming(rank=rank, action=a, start_s=start, end_s=end))
        heapq.heappush(self.events, (end, self.seq, rank))
        self.seq += 1

    def run(self) -> None:
        for rank in self.ranks:
            self.try_start(rank)
        while self.events:
            end, _, rank = heapq.heappop(self.events)
            self.ended[self.order[rank][self.pos[rank]]] = end
            self.free_at[rank] = end
            self.running[rank] = False
            self.pos[rank] += 1
            for r in self.ranks:
                self.try_start(r)
        blocked = [r for r in self.ranks if self.pos[r] < len(self.order[r])]
        if blocked:
            waits = "; ".join(
                f"rank {r} at {self.order[r][self.pos[r]]}"
                f" waits for {'/'.join(map(str, self.inputs(self.order[r][self.pos[r]])))}"
                for r in blocked
            )
            raise ValueError("schedule deadlocks: " + waits)

    def result(self) -> SimResult:
        timeline = [self.timeline[r] for r in self.ranks]
        busy = tuple(math.fsum(t.end_s - t.start_s for t in ts) for ts in timeline)
        step = max((t.end_s for ts in timeline for t in ts), default=0.0)
        bubble = 1.0 - math.fsum(busy) / (len(timeline) * step) if step > 0 else 0.0
        return SimResult(
            step_time_s=step,
            busy_s=busy,
            bubble_fraction=bubble,
            timeline=tuple(tuple(ts) for ts in timeline),
        )


__all__ = [
    "Action",
    "ActionTiming",
    "Durations",
    "Order",
    "SimResult",
    "executed_order",
    "simulate",
    "single_stage_order",
    "validate_order",
]
