"""Pipeline schedules as data: for each stage, the ordered list of forward/backward ops it runs.

This module owns what a schedule is (FlexPipe style): ``schedule[s]`` is the list of ``Op`` that
stage ``s`` executes, one at a time, in list order, within one training step of
``num_microbatches`` microbatches. The same lists drive the torch.distributed executor and the
simulator (``site_agent.pipeline.simulate``), so a schedule is tested once and run as tested.

Cross-stage data flow is implied, not listed: F(s, i) receives microbatch i's activation from
stage s-1, B(s, i) receives its gradient from stage s+1. ``validate_schedule`` checks what one
stage's list must satisfy on its own; whether the stages together can make progress is a property
of the whole schedule, checked by simulating it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

OpKind = Literal["F", "B"]


@dataclass(frozen=True)
class Op:
    """One unit of stage work: the forward (``"F"``) or backward (``"B"``) of one microbatch."""

    kind: OpKind
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"kind must be 'F' or 'B', got {self.kind!r}")
        if self.microbatch < 0:
            raise ValueError(f"microbatch must be >= 0, got {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Schedule = list[list[Op]]
"""``schedule[stage]``: the ops that stage runs, in order."""


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards.

    Backwards run in reverse microbatch order (B(m-1) .. B(0)), as drawn in the GPipe paper: the
    last stage can start the backward of the microbatch whose forward it just finished. Every stage
    holds the activations of all ``num_microbatches`` microbatches at its peak.
    """
    _check_sizes(num_stages, num_microbatches)
    forwards = [Op("F", i) for i in range(num_microbatches)]
    backwards = [Op("B", i) for i in reversed(range(num_microbatches))]
    return [forwards + backwards for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Non-interleaved 1F1B (PipeDream-Flush).

    Stage s runs ``w = min(num_stages - s - 1, num_microbatches)`` warm-up forwards, then
    alternates one forward and one backward (F(w + k), B(k)) until the forwards run out, then the
    remaining backwards in order. Microbatches flow in order everywhere; stage s holds at most
    ``min(num_stages - s, num_microbatches)`` microbatches' activations.
    """
    _check_sizes(num_stages, num_microbatches)
    schedule: Schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        ops = [Op("F", i) for i in range(warmup)]
        for k in range(num_microbatches - warmup):
            ops.append(Op("F", warmup + k))
            ops.append(Op("B", k))
        ops.extend(Op("B", i) for i in range(num_microbatches - warmup, num_microbatches))
        schedule.append(ops)
    return schedule


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
"""Schedule generators by the name a config uses."""

TORCH_SCHEDULE_STAGES: dict[str, int] = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "looped_bfs": 2,
    "interleaved_zb": 2,
    "zbv": 2,
}
"""``[site] schedule``: the names of torch's schedules a site runs (``engine.TORCH_SCHEDULES``)
and the stages each puts on one rank."""


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build the schedule called ``name`` (a key of ``SCHEDULES``)."""
    try:
        generate = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}") from None
    return generate(num_stages, num_microbatches)


def validate_schedule(
    schedule: Sequence[Sequence[Op]], num_stages: int, num_microbatches: int
) -> None:
    """Raise ``ValueError`` unless every stage runs F and B of every microbatch exactly once, with
    F(i) before B(i) on that stage."""
    _check_sizes(num_stages, num_microbatches)
    if len(schedule) != num_stages:
        raise ValueError(f"schedule has {len(schedule)} stages, expected num_stages={num_stages}")
    for stage, ops in enumerate(schedule):
        seen: set[Op] = set()
        for pos, op in enumerate(ops):
            if not isinstance(op, Op):
                raise ValueError(f"stage {stage} op {pos}: expected an Op, got {op!r}")
            if op.microbatch >= num_microbatches:
                raise ValueError(
                    f"stage {stage} op {pos}: {op} is outside num_microbatches={num_microbatches}"
                )
            if op in seen:
                raise ValueError(f"stage {stage} op {pos}: {op} appears twice")
            if op.kind == "B" and Op("F", op.microbatch) not in seen:
                raise ValueError(
                    f"stage {stage} op {pos}: {op} comes before F{op.microbatch} on that stage"
                )
            seen.add(op)
        missing = [
            str(op)
            for i in range(num_microbatches)
            for op in (Op("F", i), Op("B", i))
            if op not in seen
        ]
        if missing:
            raise ValueError(f"stage {stage} never runs {', '.join(missing)}")


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
