"""One rank's share of a pipelined job under ``torch.distributed.pipelining``.

This module owns what a rank of a pipelined site builds and runs for any job that may be
pipelined (``split`` and ``output_loss``, see ``site_agent.jobs.contract``): its stages (the
job's model cut by ``cut``, one ``PipelineStage`` each, placed by ``layout.stage_indices``),
torch's schedule named by ``[site] schedule``, and the inner step around it (gradients averaged
across replicas, the job's optimizer over this rank's parameters only, gradient clipping by the
norm over the whole pipeline, the job's scheduler). It also owns the plan: the units profiled on
one sample micro-batch and cut by the bottleneck-optimal partitioner (``partition``), computed
on one rank and shared.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from site_agent.jobs.contract import federated_state, first_tensor
from site_agent.pipeline.cut import (
    StageForward,
    Units,
    profile_units,
    strip_to_stage,
    units_of,
)
from site_agent.pipeline.layout import (
    TORCH_SCHEDULES,
    PipelineLayout,
    stage_indices,
    stages_per_rank,
)
from site_agent.pipeline.partition import PartitionPlan, partition_layers

log = logging.getLogger(__name__)

# Same constant as torch.nn.utils.clip_grad_norm_, so clipping matches the single-process trainer.
_CLIP_EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How a site pipelines its job; every rank gets the same one."""

    num_stages: int = 2
    """Pipeline ranks per replica."""
    num_replicas: int = 1
    """Data-parallel copies of the pipeline."""
    num_microbatches: int = 4
    """Micro-batches per replica and inner step."""
    schedule: str = "1f1b"
    """One of ``layout.TORCH_SCHEDULES``."""
    grad_clip: float = 1.0
    """Largest global gradient norm (0: off)."""
    profile_steps: int = 3
    """Timed passes of the per-unit profile."""
    site_id: str = "site"
    """Shown in log lines."""

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_replicas", "num_microbatches", "profile_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        stages_per_rank(self.schedule)

    @property
    def layout(self) -> PipelineLayout:
        return PipelineLayout(num_stages=self.num_stages, num_replicas=self.num_replicas)

    @property
    def total_stages(self) -> int:
        """Stages of the whole pipeline: ``num_stages`` times the schedule's stages per rank."""
        return self.num_stages * stages_per_rank(self.schedule)


def split_batch(job: Any, batch: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    """``job.split(batch)`` with the inputs as a tuple of positional arguments."""
    inputs, target = job.split(batch)
    return (inputs if isinstance(inputs, tuple) else (inputs,)), target


@dataclass(frozen=True)
class StagePlan:
    """The cut every rank applies: the units and which of them each stage holds."""

    units: Units
    partition: PartitionPlan

    def owned(self, stage: int) -> set[str]:
        return self.units.owned(self.partition.stages[stage])


def make_stage_plan(job: Any, sample_batch: Any, cfg: PipelineConfig) -> StagePlan:
    """Profile the job's units on one micro-batch of ``sample_batch`` (the site's global batch)
    and cut them into ``cfg.total_stages`` stages, the slowest as fast as possible
    (``partition_layers``); the plan is logged."""
    model: nn.Module = job.model
    units = units_of(model, getattr(job, "cut_points", None))
    num_stages = cfg.total_stages
    if num_stages > len(units):
        raise ValueError(f"{num_stages} stages exceed the model's {len(units)} units {units.names}")
    inputs, target = split_batch(job, sample_batch)
    size = inputs[0].shape[0] // (cfg.num_microbatches * cfg.num_replicas)
    mb_inputs = tuple(x[:size] for x in inputs)
    mb_target = target[:size]

    def run() -> torch.Tensor:
        loss: torch.Tensor = job.output_loss(first_tensor(model(*mb_inputs)), mb_target)
        return loss

    state = copy.deepcopy(model.state_dict())
    with torch.random.fork_rng(devices=[]):
        costs, sizes = profile_units(model, units, run, steps=cfg.profile_steps)
    model.load_state_dict(state)
    plan = partition_layers(costs, sizes, num_stages)
    log.info(
        "[site=%s rank=0] pipeline plan: stages=%d replicas=%d schedule=%s "
        "microbatches=%d units=%s boundaries=%s stage_times_s=%s "
        "predicted_bottleneck_s=%.6f lower_bound_s=%.6f",
        cfg.site_id,
        num_stages,
        cfg.num_replicas,
        cfg.schedule,
        cfg.num_microbatches,
        list(units.names),
        list(plan.boundaries),
        [round(t, 6) for t in plan.stage_times],
        plan.bottleneck,
        plan.lower_bound,
    )
    return StagePlan(units=units, partition=plan)


class RankPipeline:
    """This rank's stages of the job, torch's schedule over them, and the inner step.

    ``job``: built on this rank by the job's factory (same seed on every rank, so every stage
    starts from the single-process weights); its model is cut here, in place. Collective: every
    rank of the site constructs its own, and so joins its replica's pipeline group and its
    pipeline rank's data-parallel group (created on every rank in the same order).
    """

    def __init__(
        self, job: Any, plan: StagePlan, cfg: PipelineConfig, *, rank: int, device: torch.device
    ) -> None:
        layout = self.layout = cfg.layout
        self.num_stages = cfg.total_stages
        if plan.partition.num_stages != self.num_stages:
            raise ValueError(
                f"the plan has {plan.partition.num_stages} stages, schedule {cfg.schedule!r} on "
                f"{layout.num_stages} ranks needs {self.num_stages}"
            )
        pp_groups = [dist.new_group(layout.replica_ranks(r)) for r in range(layout.num_replicas)]
        self.pp_group = pp_groups[layout.replica_of(rank)]
        self.dp_group: dist.ProcessGroup | None = None
        if layout.num_replicas > 1:
            dp_groups = [dist.new_group(layout.stage_ranks(s)) for s in range(layout.num_stages)]
            self.dp_group = dp_groups[layout.stage_of(rank)]
        self.job = job
        self.plan = plan
        self.device = device
        self.grad_clip = cfg.grad_clip
        self.indices = stage_indices(cfg.schedule, layout.stage_of(rank), layout.num_stages)
        self.holds_first = 0 in self.indices
        self.holds_last = self.num_stages - 1 in self.indices

        model: nn.Module = job.model
        name_of = {id(p): n for n, p in model.named_parameters()}  # before the cut
        many = len(self.indices) > 1
        self.modules = [
            strip_to_stage(copy.deepcopy(model) if many else model, plan.owned(i)).to(device)
            for i in self.indices
        ]
        self.optimizer = _keep_local_parameters(job.optimizer, name_of, self.modules)
        self.scheduler = getattr(job, "scheduler", None)

        # Replicas average their gradients after the schedule (one flat all-reduce per rank):
        # torch's DDP wrapper fails under GPipe here (its reducer's bucket rebuild asserts on the
        # second step, torch 2.13, gloo), and one all-reduce per step is what DDP would send.
        self.stages = stages = [
            PipelineStage(StageForward(module), index, self.num_stages, device, group=self.pp_group)
            for index, module in zip(self.indices, self.modules, strict=True)
        ]
        schedule_class = get_schedule_class(TORCH_SCHEDULES[cfg.schedule][0])
        self.schedule = schedule_class(
            stages if len(stages) > 1 else stages[0],
            n_microbatches=cfg.num_microbatches,
            loss_fn=job.output_loss,
            scale_grads=True,
        )

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's federated tensors, by full-model name."""
        out: dict[str, torch.Tensor] = {}
        for module in self.modules:
            out.update(federated_state(module))
        return out

    def train_step(self, batch: Any) -> torch.Tensor | None:
        """One inner step on this replica's ``batch``; returns, where the last stage lives, the
        mean of its micro-batch losses (detached)."""
        inputs, target = split_batch(self.job, batch)
        for module in self.modules:
            module.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.holds_last:
            kwargs = {"target": target, "losses": losses}
        self.schedule.step(*(inputs if self.holds_first else ()), **kwargs)
        self._average_over_replicas()
        self._clip()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        if not self.holds_last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).mean()

    def _average_over_replicas(self) -> None:
        if self.dp_group is None:
            return
        params = [p for m in self.modules for p in m.parameters()]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
        flat.div_(self.layout.num_replicas)
        for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    def _clip(self) -> None:
        """Scale gradients so the norm over the whole model is at most ``grad_clip``; the
        squared norms of every stage of the pipeline are summed over ``pp_group``."""
        if self.grad_clip <= 0:
            return
        grads = [p.grad for m in self.modules for p in m.parameters() if p.grad is not None]
        squared = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads])
            squared = norms.pow(2).sum()
        if self.layout.num_stages > 1:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.pp_group)
        coef = torch.clamp(self.grad_clip / (squared.sqrt() + _CLIP_EPS), max=1.0)
        for g in grads:
            g.mul_(coef)


def _keep_local_parameters(
    optimizer: torch.optim.Optimizer, name_of: Mapping[int, str], modules: Sequence[nn.Module]
) -> torch.optim.Optimizer:
    """The job's optimizer (and so its scheduler) made to step this rank's parameters only:
    each group keeps its hyper-parameters and the stage modules' tensors of its parameters
    (``name_of``: the whole model's parameter names by tensor id, taken before the cut)."""
    local = {n: p for m in modules for n, p in m.named_parameters()}
    for group in optimizer.param_groups:
        group["params"] = [
            local[name_of[id(p)]] for p in group["params"] if name_of[id(p)] in local
        ]
    optimizer.state.clear()
    return optimizer


__all__ = ["PipelineConfig", "RankPipeline", "StagePlan", "make_stage_plan"]
