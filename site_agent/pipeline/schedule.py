"""A schedule as data, the form the simulator times: per stage, the ordered list of its ops.

This module owns what such a schedule is: ``schedule[s]`` is the list of ``Op`` that stage ``s``
executes, one at a time, in list order, within one training step of ``num_microbatches``
microbatches. Cross-stage data flow is implied, not listed: F(s, i) receives microbatch i's
activation from stage s-1, B(s, i) receives its gradient from stage s+1. ``validate_schedule``
checks what one stage's list must satisfy on its own; whether the stages together can make
progress is a property of the whole schedule, checked by simulating it.
"""

from __future__ import annotations

from collections.abc import Sequence
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
