"""What every rank of a pipelined site must agree on: the pipeline's configuration and the job.

This module owns ``PipelineConfig`` (stages, replicas, micro-batches, schedule, partition and
point-to-point settings, validated on construction), ``PipelineJob`` (model, inner optimizer,
pipeline and seeds; all ranks are started with the same one) and each replica's data seed.

Data: the inner step's batch (``InnerOptimConfig.batch_size`` sequences, the site's whole step)
is split evenly over the replicas, and each replica's share into ``num_microbatches``
micro-batches. Replica r samples its own data from ``replica_seed(data_seed, r, num_replicas)``.
Stage 0 needs the tokens and the last stage the targets of the same batch: both hold a sampler
with that seed and draw in lockstep, so no targets travel between stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from site_agent.model import ModelConfig
from site_agent.pipeline.mailbox import P2P_MODES
from site_agent.pipeline.partition import TransferModel
from site_agent.pipeline.schedule import SCHEDULES
from site_agent.pipeline.stage import PipelineLayout
from site_agent.trainer import InnerOptimConfig


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How a site lays out its ranks and runs its pipeline."""

    num_stages: int = 1
    """Pipeline stages per replica."""
    num_replicas: int = 1
    """Data-parallel copies of the pipeline; the site's world size is stages x replicas."""
    num_microbatches: int = 1
    """Micro-batches per inner step and replica."""
    schedule: str = "1f1b"
    """Name of the schedule in ``SCHEDULES``."""
    boundaries: tuple[int, ...] | None = None
    """First layer of each stage, fixed by hand; ``None`` profiles the model and partitions it."""
    profile_steps: int = 3
    """Timed passes of ``profile_layers`` before partitioning."""
    transfer: TransferModel = field(default_factory=TransferModel)
    """Cost of sending one activation between stages, as the partitioner sees it."""
    sync_timing: bool = False
    """On CUDA, synchronize around every op so per-op timestamps are kernel time (slower)."""
    p2p: str = "auto"
    """How stages exchange tensors: ``grouped`` (each send posted with the next receive in one
    batch, as NCCL needs), ``preposted`` (receives posted one op ahead, sends at once; gloo) or
    ``auto`` (preposted on gloo, grouped otherwise)."""

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_replicas", "num_microbatches", "profile_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"pipeline.{name} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"pipeline.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.p2p not in P2P_MODES:
            raise ValueError(
                f"pipeline.p2p must be one of {', '.join(P2P_MODES)}, got {self.p2p!r}"
            )
        if self.boundaries is not None:
            b = tuple(self.boundaries)
            if len(b) != self.num_stages:
                raise ValueError(
                    f"pipeline.boundaries has {len(b)} entries, expected num_stages="
                    f"{self.num_stages}"
                )
            if not b or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:], strict=False)):
                raise ValueError(
                    f"pipeline.boundaries must start at 0 and strictly increase, got {b}"
                )


@dataclass(frozen=True, kw_only=True)
class PipelineJob:
    """Everything every rank of a site must agree on; all ranks are started with the same one."""

    model: ModelConfig
    """The model every stage is cut from."""
    optim: InnerOptimConfig
    """Inner AdamW; ``batch_size`` is the site's whole batch per inner step."""
    pipeline: PipelineConfig
    """Stages, replicas, micro-batches and schedule."""
    model_seed: int = 0
    """Seed of ``build_model``: the initial weights."""
    data_seed: int = 0
    """Seed of the site's data; replica r draws from ``replica_seed(data_seed, r, replicas)``."""
    site_id: str = "site"
    """Shown in log lines."""

    def __post_init__(self) -> None:
        pipe = self.pipeline
        per_step = pipe.num_replicas * pipe.num_microbatches
        if self.optim.batch_size % per_step != 0:
            raise ValueError(
                f"inner_optim.batch_size={self.optim.batch_size} must be divisible by "
                f"pipeline.num_replicas * pipeline.num_microbatches = {per_step}"
            )
        num_layers = self.model.num_layers + 2
        if pipe.num_stages > num_layers:
            raise ValueError(
                f"pipeline.num_stages={pipe.num_stages} exceeds the model's {num_layers} layers"
            )
        if pipe.boundaries is not None and pipe.boundaries[-1] >= num_layers:
            raise ValueError(
                f"pipeline.boundaries={pipe.boundaries} goes past the model's {num_layers} layers"
            )

    @property
    def layout(self) -> PipelineLayout:
        return PipelineLayout(
            num_stages=self.pipeline.num_stages, num_replicas=self.pipeline.num_replicas
        )

    @property
    def microbatch_size(self) -> int:
        """Sequences per micro-batch."""
        pipe = self.pipeline
        return self.optim.batch_size // (pipe.num_replicas * pipe.num_microbatches)


def replica_seed(data_seed: int, replica: int, num_replicas: int) -> int:
    """Data seed of one replica: distinct per (site seed, replica); replica 0 of a one-replica
    site uses ``data_seed`` itself, as ``LocalTrainer`` would."""
    return data_seed * num_replicas + replica
