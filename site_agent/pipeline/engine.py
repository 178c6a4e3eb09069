"""One rank's share of a pipelined job under ``torch.distributed.pipelining``.

This module owns what a rank of a pipelined site builds and runs for any job that may be
pipelined (``split`` and ``output_loss``, see ``site_agent.jobs.contract``): its stages (the
job's model cut by ``cut``, one ``PipelineStage`` each), how the replicas of a stage combine
their gradients (``[site] data_parallel``: torch's DDP, FSDP2's ``fully_shard`` or one
all-reduce), torch's schedule named by ``[site] schedule``, and the inner step around it (the
job's optimizer over this rank's parameters only, gradient clipping by the norm over the whole
pipeline, the job's scheduler), and this rank's federated state whole or by shard.
It also owns the plan: the units profiled on one sample micro-batch and cut by the
bottleneck-optimal partitioner (``partition``), computed on one rank and shared.

Rank layout as ``stage.PipelineLayout``: rank = replica * pipeline ranks + pipeline rank. A
schedule with several stages per rank (interleaved, looped, zero-bubble V) puts stage
``pp_rank + k * pp_size`` on each rank, or the V shape (``pp_rank`` and ``2 pp_size - 1 -
pp_rank``) for ``zbv``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from site_agent.jobs.contract import federated_state, first_tensor
from site_agent.pipeline.cut import (
    StageForward,
    Units,
    profile_units,
    strip_to_stage,
    units_of,
)
from site_agent.pipeline.partition import PartitionPlan, TransferModel, partition_layers
from site_agent.pipeline.schedule import TORCH_SCHEDULE_STAGES
from site_agent.pipeline.stage import PipelineLayout

log = logging.getLogger(__name__)

# Same constant as torch.nn.utils.clip_grad_norm_, so clipping matches the single-process trainer.
_CLIP_EPS = 1e-6

TORCH_SCHEDULES: dict[str, tuple[Any, int]] = {
    name: (cls, TORCH_SCHEDULE_STAGES[name])
    for name, cls in [
        ("gpipe", ScheduleGPipe),
        ("1f1b", Schedule1F1B),
        ("interleaved_1f1b", ScheduleInterleaved1F1B),
        ("looped_bfs", ScheduleLoopedBFS),
        ("interleaved_zb", ScheduleInterleavedZeroBubble),
        ("zbv", ScheduleZBVZeroBubble),
    ]
}
"""``[site] schedule`` -> (torch's schedule class, stages per rank)."""


DATA_PARALLEL = ("allreduce", "ddp", "fsdp")
"""``[site] data_parallel``: how the replicas of a stage combine their gradients (see
:class:`RankPipeline`)."""

SPLIT_BACKWARD_SCHEDULES = ("interleaved_zb", "zbv")
"""Schedules that split each backward into an input and a weight part. torch's stage computes
the weight part with ``torch.autograd.grad`` and adds it to ``.grad`` itself, so the parameters'
gradient accumulators never run and DDP's reducer hooks (which hang on them) never fire: a DDP
replica's gradients would silently stay local. FSDP's reduction is called by the schedule
(``perform_reduce_grad``) and the all-reduce by this module, so both run them."""


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


def stages_per_rank(schedule: str) -> int:
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(TORCH_SCHEDULES)}, got {schedule!r}")
    return TORCH_SCHEDULES[schedule][1]


def stage_indices(schedule: str, pp_rank: int, pp_size: int) -> list[int]:
    """The pipeline stages rank ``pp_rank`` of ``pp_size`` holds under ``schedule``."""
    k = stages_per_rank(schedule)
    if schedule == "zbv":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + j * pp_size for j in range(k)]


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


def make_stage_plan(
    job: Any,
    sample_batch: Any,
    num_stages: int,
    *,
    num_microbatches: int,
    boundaries: Sequence[int] | None = None,
    transfer: TransferModel | None = None,
    profile_steps: int = 3,
) -> StagePlan:
    """Profile the job's units on one micro-batch of ``sample_batch`` and cut them into
    ``num_stages`` stages (or at ``boundaries``, unit indices of each stage's first unit)."""
    model: nn.Module = job.model
    units = units_of(model, getattr(job, "cut_points", None))
    if num_stages > len(units):
        raise ValueError(f"{num_stages} stages exceed the model's {len(units)} units {units.names}")
    inputs, target = split_batch(job, sample_batch)
    size = inputs[0].shape[0] // num_microbatches
    mb_inputs = tuple(x[:size] for x in inputs)
    mb_target = target[:size]

    def run() -> torch.Tensor:
        loss: torch.Tensor = job.output_loss(first_tensor(model(*mb_inputs)), mb_target)
        return loss

    state = copy.deepcopy(model.state_dict())
    with torch.random.fork_rng(devices=[]):
        costs, sizes = profile_units(model, units, run, steps=profile_steps)
    model.load_state_dict(state)
    if boundaries is None:
        plan = partition_layers(costs, sizes, num_stages, transfer)
    else:
        from site_agent.pipeline.setup import fixed_plan

        plan = fixed_plan(costs, sizes, boundaries, transfer)
    return StagePlan(units=units, partition=plan)


class RankPipeline:
    """This rank's stages of the job, torch's schedule over them, and the inner step.

    ``job``: built on this rank by the job's factory (same seed on every rank, so every stage
    starts from the single-process weights); its model is cut here, in place. ``pp_group`` holds
    this replica's pipeline ranks, ``dp_group`` this pipeline rank in every replica (``None``
    for one replica).
    """

    def __init__(
        self,
        *,
        job: Any,
        plan: StagePlan,
        schedule: str,
        num_microbatches: int,
        layout: PipelineLayout,
        rank: int,
        device: torch.device,
        pp_group: dist.ProcessGroup | None,
        dp_group: dist.ProcessGroup | None,
        grad_clip: float,
        data_parallel: str = "ddp",
    ) -> None:
        check_data_parallel(data_parallel, schedule, layout.num_replicas)
        pp_size = layout.num_stages
        self.layout = layout
        self.pp_rank = layout.stage_of(rank)
        self.replica = layout.replica_of(rank)
        self.num_stages = pp_size * stages_per_rank(schedule)
        if plan.partition.num_stages != self.num_stages:
            raise ValueError(
                f"the plan has {plan.partition.num_stages} stages, schedule {schedule!r} on "
                f"{pp_size} ranks needs {self.num_stages}"
            )
        self.job = job
        self.device = device
        self.pp_group = pp_group
        self.grad_clip = grad_clip
        self.indices = stage_indices(schedule, self.pp_rank, pp_size)
        self.holds_first = 0 in self.indices
        self.holds_last = self.num_stages - 1 in self.indices

        model: nn.Module = job.model
        name_of = {id(p): n for n, p in model.named_parameters()}  # before the cut
        many = len(self.indices) > 1
        self.modules = [
            strip_to_stage(copy.deepcopy(model) if many else model, plan.owned(i)).to(device)
            for i in self.indices
        ]
        self.scheduler = getattr(job, "scheduler", None)

        # Replicas of a stage combine their gradients in one of three ways (``data_parallel``):
        # - "ddp": the stage module is torch's DistributedDataParallel on dp_group, and the
        #   PipelineStage gets the wrapper itself, so torch's stage runs every micro-batch's
        #   backward under no_sync and arms the reducer only for the last one (one bucketed
        #   all-reduce per step, overlapping that backward);
        # - "fsdp": the stage module is FSDP2's fully_shard on dp_group (parameters, gradients
        #   and optimizer state sharded; kept unsharded from the first forward to the end of the
        #   step, as torchtitan does under pipelining); the schedule reduce-scatters at the end;
        # - "allreduce": plain modules, one flat all-reduce over dp_group after the schedule.
        # Each divides the sum by the number of replicas; the schedule divides by the number
        # of micro-batches (scale_grads) after that reduction.
        self.dp_group = dp_group
        self.data_parallel = data_parallel if dp_group is not None else "allreduce"
        self.wrappers = [
            _wrap(StageForward(m), self.data_parallel, dp_group, device) for m in self.modules
        ]
        # After fully_shard, which replaces the parameters by sharded ones.
        self.optimizer = _keep_local_parameters(job.optimizer, name_of, self.modules)
        self.stages = [
            PipelineStage(wrapper, index, self.num_stages, device, group=pp_group)
            for index, wrapper in zip(self.indices, self.wrappers, strict=True)
        ]
        cls, per_rank = TORCH_SCHEDULES[schedule]
        self.schedule = cls(
            self.stages if per_rank > 1 else self.stages[0],
            n_microbatches=num_microbatches,
            loss_fn=job.output_loss,
            scale_grads=True,
        )

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's federated tensors, by full-model name: the live parameters and buffers
        (under FSDP a parameter is a ``DTensor`` holding this rank's shard)."""
        out: dict[str, torch.Tensor] = {}
        for module in self.modules:
            out.update(federated_state(module))
        return out

    def full_state(self) -> dict[str, torch.Tensor]:
        """This rank's federated tensors, whole. Under FSDP each sharded one is all-gathered over
        ``dp_group``: every replica's rank of this pipeline rank must call it together."""
        return {
            name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            for name, tensor in self.state().items()
        }

    def load_state(self, named: Mapping[str, Any]) -> None:
        """Copy whole tensors (arrays or tensors, by full-model name) into this rank's federated
        tensors; under FSDP each rank keeps its shard (no communication)."""
        with torch.no_grad():
            for name, tensor in self.state().items():
                value = named[name]
                whole = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
                if isinstance(tensor, DTensor):
                    whole = distribute_tensor(
                        whole.to(tensor.device, tensor.dtype),
                        tensor.device_mesh,
                        tensor.placements,
                        src_data_rank=None,
                    )
                tensor.copy_(whole)

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's ``state_dict`` with plain tensors: under FSDP a sharded state tensor
        becomes this rank's shard (it loads back under the same layout only)."""
        packed = self.optimizer.state_dict()
        packed["state"] = {
            index: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for index, st in packed["state"].items()
        }
        return packed

    def load_optimizer_state(self, packed: Mapping[str, Any]) -> None:
        """Load what :meth:`optimizer_state` returned on this rank under the same layout."""
        # A copy: torch's load_state_dict keeps tensors already of the parameter's dtype and
        # device as they are, and the steps would then update the caller's checkpoint in place.
        self.optimizer.load_state_dict(copy.deepcopy(dict(packed)))
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    continue
                shard = p.to_local()
                st = self.optimizer.state.get(p, {})
                for key, value in st.items():
                    # A state tensor the shape of the shard is the shard of a sharded one
                    # (AdamW's moments); a scalar (its step) stays as it is.
                    if (
                        isinstance(value, torch.Tensor)
                        and value.dim()
                        and value.shape == shard.shape
                    ):
                        st[key] = DTensor.from_local(
                            value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                        )

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
        # DDP's reducer must be armed by torch's stage alone, before the last micro-batch's
        # backward (backward_maybe_with_nosync). A DDP forward outside no_sync arms it too, and
        # the stage runs one: its shape inference on the first step calls the module directly.
        # Armed so, the first micro-batch's backward all-reduced once more and recorded every
        # parameter for the bucket rebuild; the last backward recorded them again, and under
        # GPipe (whose forwards all run before the rebuild) the second step's forward failed
        # the reducer's assertion "rebuilt parameter indices size is not same as original
        # model parameters size" (2 x the parameters). Sync is off for the whole step instead.
        with contextlib.ExitStack() as ddp_sync_off:
            for wrapper in self.wrappers:
                if isinstance(wrapper, DistributedDataParallel):
                    ddp_sync_off.enter_context(wrapper.no_sync())
            self.schedule.step(*(inputs if self.holds_first else ()), **kwargs)
        if self.data_parallel == "allreduce":
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
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _clip(self) -> None:
        """Scale gradients so the norm over the whole model is at most ``grad_clip``; the
        squared norms of every stage of the pipeline are summed over ``pp_group`` (and, under
        FSDP, of every shard of a stage over ``dp_group`` first)."""
        if self.grad_clip <= 0:
            return
        grads = [_local(p.grad) for m in self.modules for p in m.parameters() if p.grad is not None]
        squared = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads])
            squared = norms.pow(2).sum()
        if self.data_parallel == "fsdp":
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.dp_group)
        if self.layout.num_stages > 1:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.pp_group)
        coef = torch.clamp(self.grad_clip / (squared.sqrt() + _CLIP_EPS), max=1.0)
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its shard (a view) if FSDP sharded it, else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _wrap(
    module: nn.Module, data_parallel: str, dp_group: dist.ProcessGroup | None, device: torch.device
) -> nn.Module:
    """``module`` as its replicas share it over ``dp_group`` (see ``RankPipeline``)."""
    if dp_group is None or data_parallel == "allreduce":
        return module
    if data_parallel == "ddp":
        # No device_ids: the stage's inputs are already on the rank's device (CPU or its GPU).
        # Buffers are not broadcast at each forward: replicas start equal (same seed, and DDP
        # broadcasts them once here) and the allreduce mode does not sync them either.
        return DistributedDataParallel(module, process_group=dp_group, forward_sync_buffers=False)
    # The dimension is named after the group: DTensor caches sharding decisions by mesh, and
    # meshes compare by ranks and names but not by process group, so in a process that destroys
    # its groups and makes new ones (the tests' reused workers) a cached decision carried the
    # old mesh, whose group name then meant nothing, or another group of this run.
    mesh = DeviceMesh.from_group(
        dp_group, device.type, mesh_dim_names=(f"replicas_{dp_group.group_name}",)
    )
    fully_shard(module, mesh=mesh, reshard_after_forward=False)
    return module


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


__all__ = [
    "DATA_PARALLEL",
    "SPLIT_BACKWARD_SCHEDULES",
    "TORCH_SCHEDULES",
    "RankPipeline",
    "StagePlan",
    "check_data_parallel",
    "make_stage_plan",
    "stage_indices",
    "stages_per_rank",
]
