"""The rank layout of a pipelined site: which rank holds which pipeline rank of which replica.

``PipelineLayout``: rank ``replica * num_stages + stage``, so the ranks of one replica's
pipeline are contiguous and rank 0 is stage 0 of replica 0, the site leader.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """``num_stages`` x ``num_replicas`` ranks: rank = ``replica * num_stages + stage``."""

    num_stages: int
    """Pipeline stages per replica."""
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
