"""Where a pipelined site's stages run (docs/pipelines.md): ``PipelineLayout`` (which rank is
which stage of which replica), the schedules a site may run and the stages each puts on a rank,
and the ``data_parallel`` modes each allows. Pure Python: ``site_agent.config`` checks with it.
"""

from __future__ import annotations

from dataclasses import dataclass

TORCH_SCHEDULES: dict[str, tuple[str, int]] = {
    "gpipe": ("GPipe", 1),
    "1f1b": ("1F1B", 1),
    "interleaved_1f1b": ("Interleaved1F1B", 2),
    "looped_bfs": ("LoopedBFS", 2),
    "interleaved_zb": ("InterleavedZeroBubble", 2),
    "zbv": ("ZBVZeroBubble", 2),
}
"""``[site] schedule`` -> (torch's name, for ``get_schedule_class``; stages per rank)."""


def stages_per_rank(schedule: str) -> int:
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(TORCH_SCHEDULES)}, got {schedule!r}")
    return TORCH_SCHEDULES[schedule][1]


DATA_PARALLEL = ("allreduce", "ddp", "fsdp")
"""``[site] data_parallel``: how the replicas of a stage combine their gradients."""

SPLIT_BACKWARD_SCHEDULES = ("interleaved_zb", "zbv")
"""Schedules that split each backward into an input and a weight part: the weight part bypasses
the gradient accumulators DDP's hooks hang on, so ``ddp`` replicas would not average it."""


def check_data_parallel(
    data_parallel: str, schedule: str, num_replicas: int, *, prefix: str = ""
) -> None:
    """Refuse an unknown ``data_parallel`` and, with more than one replica, a combination with
    ``schedule`` that cannot run (``prefix``: how the caller's config names the fields)."""
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(
            f"{prefix}data_parallel must be one of {', '.join(DATA_PARALLEL)}, "
            f"got {data_parallel!r}"
        )
    if num_replicas > 1 and data_parallel == "ddp" and schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ValueError(
            f"{prefix}data_parallel = 'ddp' cannot run {prefix}schedule = {schedule!r}: its "
            "split backward computes weight gradients without DDP's hooks, so replicas would "
            f"not average them; use {prefix}data_parallel = 'fsdp' or 'allreduce' with "
            f"{', '.join(SPLIT_BACKWARD_SCHEDULES)}"
        )


def stage_indices(schedule: str, pp_rank: int, pp_size: int) -> list[int]:
    """The pipeline stages rank ``pp_rank`` of ``pp_size`` holds under ``schedule``."""
    k = stages_per_rank(schedule)
    if schedule == "zbv":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + j * pp_size for j in range(k)]


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """``num_stages`` x ``num_replicas`` ranks: rank = ``replica * num_stages + stage``, where
    ``stage`` is the pipeline rank (it holds ``stage_indices`` of the schedule's stages)."""

    num_stages: int
    """Pipeline ranks per replica."""
    num_replicas: int
    """Data-parallel copies of the whole pipeline."""

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas

    def rank(self, *, stage: int, replica: int) -> int:
        assert 0 <= stage < self.num_stages and 0 <= replica < self.num_replicas
        return replica * self.num_stages + stage

    def stage_of(self, rank: int) -> int:
        return rank % self.num_stages

    def replica_of(self, rank: int) -> int:
        return rank // self.num_stages

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` in every replica: one data-parallel group."""
        return [self.rank(stage=stage, replica=r) for r in range(self.num_replicas)]

    def replica_ranks(self, replica: int) -> list[int]:
        """The ranks of one replica's pipeline, stage order."""
        return [self.rank(stage=s, replica=replica) for s in range(self.num_stages)]
