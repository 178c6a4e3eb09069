"""Discrete-event simulation of one pipeline step from a schedule (see ``schedule``).

This module owns the timing model the schedules are judged by. It reads the same per-stage op lists
the executor runs. Each stage executes its ops in list order, one at a time. F(s, i) needs F(s-1, i)
finished plus one transfer; B(s, i) needs B(s+1, i) finished plus one transfer, and F(s, i), which
precedes it on the same stage. Transfers are pure delay: links are never contended. The step starts
at time 0 on every stage.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from site_agent.pipeline.schedule import Op, validate_schedule


@dataclass(frozen=True, kw_only=True)
class OpTiming:
    """When one op ran on one stage."""

    stage: int
    op: Op
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Outcome of simulating one step."""

    step_time_s: float
    """Time from the step's start until the last op on any stage ends."""
    busy_s: tuple[float, ...]
    """Per stage: seconds spent running ops."""
    bubble_fraction: float
    """Idle share of all stages' time: ``1 - sum(busy_s) / (num_stages * step_time_s)``."""
    peak_in_flight: tuple[int, ...]
    """Per stage: most microbatches at once whose F has finished and B has not (stored
    activations)."""
    timeline: tuple[tuple[OpTiming, ...], ...]
    """Per stage: each op's start and end, in the stage's list order."""


def simulate(
    schedule: Sequence[Sequence[Op]],
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    transfer_s: float = 0.0,
) -> SimResult:
    """Simulate one step of ``schedule``.

    ``forward_s`` and ``backward_s`` are one microbatch's forward/backward seconds per stage (a
    list of length ``num_stages``, or one number for every stage); ``transfer_s`` is the time to
    move one activation or gradient between adjacent stages. Raises ``ValueError`` for an invalid
    schedule (see ``validate_schedule``) and for one that deadlocks.
    """
    num_stages = len(schedule)
    if num_stages == 0:
        raise ValueError("schedule has no stages")
    num_microbatches = sum(1 for op in schedule[0] if isinstance(op, Op) and op.kind == "F")
    if num_microbatches == 0:
        raise ValueError("schedule runs no microbatches: stage 0 has no forward op")
    validate_schedule(schedule, num_stages, num_microbatches)
    fwd = _per_stage(forward_s, num_stages, "forward_s")
    bwd = _per_stage(backward_s, num_stages, "backward_s")
    if not (math.isfinite(transfer_s) and transfer_s >= 0):
        raise ValueError(f"transfer_s must be finite and >= 0, got {transfer_s!r}")

    sim = _Simulation(schedule, fwd, bwd, transfer_s)
    sim.run()
    sim.check_finished()
    return sim.result()


class _Simulation:
    """The event loop of one step: which op each stage runs next and when each op finished."""

    def __init__(
        self,
        schedule: Sequence[Sequence[Op]],
        fwd: list[float],
        bwd: list[float],
        transfer_s: float,
    ) -> None:
        num_stages = len(schedule)
        self.schedule = schedule
        self.num_stages = num_stages
        self.fwd = fwd
        self.bwd = bwd
        self.transfer_s = transfer_s
        self.finished_at: dict[tuple[int, Op], float] = {}
        self.next_pos = [0] * num_stages
        self.running = [False] * num_stages
        self.free_at = [0.0] * num_stages
        self.in_flight = [0] * num_stages
        self.peak = [0] * num_stages
        self.timeline: list[list[OpTiming]] = [[] for _ in range(num_stages)]
        # (end time, tie-break sequence, stage): the op at next_pos[stage] is running until then.
        self.events: list[tuple[float, int, int]] = []
        self.seq = 0

    def dependency(self, stage: int, op: Op) -> tuple[int, Op] | None:
        """The op on a neighbouring stage whose output ``op`` consumes, if any."""
        if op.kind == "F":
            return (stage - 1, op) if stage > 0 else None
        return (stage + 1, op) if stage < self.num_stages - 1 else None

    def try_start(self, stage: int) -> None:
        if self.running[stage] or self.next_pos[stage] == len(self.schedule[stage]):
            return
        op = self.schedule[stage][self.next_pos[stage]]
        start = self.free_at[stage]
        dep = self.dependency(stage, op)
        if dep is not None:
            if dep not in self.finished_at:
                return  # started again when that op finishes
            start = max(start, self.finished_at[dep] + self.transfer_s)
        end = start + (self.fwd[stage] if op.kind == "F" else self.bwd[stage])
        self.running[stage] = True
        self.timeline[stage].append(OpTiming(stage=stage, op=op, start_s=start, end_s=end))
        heapq.heappush(self.events, (end, self.seq, stage))
        self.seq += 1

    def run(self) -> None:
        """Run every op that can run, in order of the time it ends."""
        for stage in range(self.num_stages):
            self.try_start(stage)
        while self.events:
            end, _, stage = heapq.heappop(self.events)
            op = self.schedule[stage][self.next_pos[stage]]
            self.finished_at[(stage, op)] = end
            self.free_at[stage] = end
            self.running[stage] = False
            self.next_pos[stage] += 1
            self.in_flight[stage] += 1 if op.kind == "F" else -1
            self.peak[stage] = max(self.peak[stage], self.in_flight[stage])
            self.try_start(stage)
            # The only other stage this op can unblock is the one that consumes its output.
            consumer = stage + 1 if op.kind == "F" else stage - 1
            if 0 <= consumer < self.num_stages:
                self.try_start(consumer)

    def check_finished(self) -> None:
        """Raise ``ValueError`` naming what each stage waits for unless every op ran."""
        schedule = self.schedule
        blocked = [s for s in range(self.num_stages) if self.next_pos[s] < len(schedule[s])]
        if blocked:
            waits = []
            for s in blocked:
                op = schedule[s][self.next_pos[s]]
                dep = self.dependency(s, op)
                assert dep is not None, "an op with no cross-stage input can always start"
                waits.append(f"stage {s} at {op} waits for {dep[1]} from stage {dep[0]}")
            raise ValueError("schedule deadlocks: " + "; ".join(waits))

    def result(self) -> SimResult:
        timeline = self.timeline
        busy = tuple(math.fsum(t.end_s - t.start_s for t in ops) for ops in timeline)
        step_time = max(t.end_s for ops in timeline for t in ops)
        bubble = 1.0 - math.fsum(busy) / (self.num_stages * step_time) if step_time > 0 else 0.0
        return SimResult(
            step_time_s=step_time,
            busy_s=busy,
            bubble_fraction=bubble,
            peak_in_flight=tuple(self.peak),
            timeline=tuple(tuple(ops) for ops in timeline),
        )


def _per_stage(value: float | Sequence[float], num_stages: int, name: str) -> list[float]:
    values = (
        [float(value)] * num_stages
        if isinstance(value, (int, float))
        else [float(v) for v in value]
    )
    if len(values) != num_stages:
        raise ValueError(f"{name} has {len(values)} entries, expected num_stages={num_stages}")
    for s, v in enumerate(values):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}[{s}] must be finite and >= 0, got {v!r}")
    return values
