"""One rank's share of a pipelined job (docs/pipelines.md): ``PipelineConfig``; the plan, the
job's units profiled on one micro-batch and cut by ``partition`` on one rank; ``RankPipeline``,
this rank's stages, how their replicas combine gradients, torch's schedule and the inner step.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from site_agent.jobs.contract import federated_state, first_tensor
from site_agent.pipeline.chain import Cut, check_stages_compose, cut_stage
from site_agent.pipeline.cut import StageForward, units_of
from site_agent.pipeline.layout import (
    TORCH_SCHEDULES,
    PipelineLayout,
    check_data_parallel,
    stage_indices,
    stages_per_rank,
)
from site_agent.pipeline.partition import PartitionPlan, partition_at, partition_layers
from site_agent.pipeline.profile import profile_units

log = logging.getLogger(__name__)

# Same constant as torch.nn.utils.clip_grad_norm_, so clipping matches the single-process trainer.
_CLIP_EPS = 1e-6

OLDEST_TORCH = "2.13"
"""The oldest torch a pipelined site runs on: before it, torch's stages could not hand on the
model's integer inputs (2.7: "only Tensors of floating point dtype can require gradients"; 2.12:
"has gradients None and is expecting to send gradients"), which every language model's stages do
(docs/pipelines.md)."""


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
    data_parallel: str = "ddp"
    """How a stage's replicas combine gradients: ``ddp``, ``fsdp`` or ``allreduce``
    (``layout.check_data_parallel`` says which schedules each runs)."""
    grad_clip: float = 1.0
    """Largest global gradient norm (0: off)."""
    profile_steps: int = 3
    """Timed passes of the per-unit profile."""
    site_id: str = "site"
    """Shown in log lines."""
    sync_shards: bool = False
    """Each rank syncs the federated tensors it holds (``stagesync.StageSync``: θ, residuals
    and the encoding of its own rows; the leader relays encoded bytes). False: the leader
    gathers the whole model for the agent (a site with differential privacy or secure
    aggregation, which a sharded site does not do yet)."""
    error_feedback_decay: float = 1.0
    """The decay of each rank's error-feedback residuals under ``sync_shards``."""
    rank_timeout_s: float = 1800.0
    """How long a rank waits in one of a sync call's collectives under ``sync_shards`` (for a
    rank that died or failed inside the call) before it gives up with an error. The wait for
    the leader's next command, which spans its WAN exchanges, is not bounded by it."""
    cut_record: str = ""
    """A file where rank 0 keeps its cut of the job into stages (the units' names, a digest of
    the parameters' shapes, each stage's first unit): a later start of the same model into as
    many stages cuts the same way,
    so that a restarted site's ranks hold the tensors their checkpointed optimizer state is of
    (the cut follows measured step times otherwise). Empty: cut afresh at every start."""

    def __post_init__(self) -> None:
        layout = self.layout  # PipelineLayout checks num_stages and num_replicas
        for name in ("num_microbatches", "profile_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        stages_per_rank(self.schedule)
        check_data_parallel(self.data_parallel, self.schedule, layout.num_replicas)

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
    """The cut every rank applies, and the partition it comes from."""

    cut: Cut
    partition: PartitionPlan

    def stage(self, model: nn.Module, index: int) -> StageForward:
        """``model`` cut, in place, to stage ``index`` (``chain.cut_stage``)."""
        return cut_stage(model, self.cut, index)


def make_stage_plan(job: Any, sample_batch: Any, cfg: PipelineConfig) -> StagePlan:
    """Profile the job's units on one micro-batch of ``sample_batch`` (the site's global batch)
    and cut them into ``cfg.total_stages`` stages, the slowest as fast as possible
    (``partition_layers``); the plan is logged."""
    if torch.__version__ < OLDEST_TORCH:
        raise ValueError(
            f"a pipelined site needs torch >= {OLDEST_TORCH}, this is torch {torch.__version__}: "
            "upgrade torch, or run the site as one process"
        )
    model: nn.Module = job.model
    units = units_of(model, getattr(job, "cut_points", None))
    num_stages = cfg.total_stages
    if num_stages > len(units):
        raise ValueError(f"{num_stages} stages exceed the model's {len(units)} units {units.names}")
    inputs, target = split_batch(job, sample_batch)
    floating = [i for i, x in enumerate(inputs[1:], 1) if x.is_floating_point()]
    if floating:
        raise ValueError(
            f"the model's input {floating[0]} (after split) is floating point: inputs beyond "
            "the first reach later stages only when they are integer or bool tensors (masks, "
            "ids), so give it as one, or compute it inside the model"
        )
    size = inputs[0].shape[0] // (cfg.num_microbatches * cfg.num_replicas)
    mb_inputs = tuple(x[:size] for x in inputs)

    def run() -> torch.Tensor:
        loss: torch.Tensor = job.output_loss(first_tensor(model(*mb_inputs)), target[:size])
        return loss

    state = copy.deepcopy(model.state_dict())  # put back: the forwards move statistics
    was_training = model.training
    model.train()  # as the stages run: dropout on, BatchNorm on batch statistics
    try:
        with torch.random.fork_rng(devices=[]):
            costs, sizes = profile_units(model, units, run, steps=cfg.profile_steps)
            key = _cut_key(model, units.names)
            plan = _recorded_plan(cfg.cut_record, key, num_stages, costs, sizes)
            if plan is None:
                plan = partition_layers(costs, sizes, num_stages)
            cut = Cut.traced(model, units, plan.stages, mb_inputs)
            check_stages_compose(model, cut, mb_inputs)
    finally:
        model.load_state_dict(state)
        model.train(was_training)
    log.info(
        f"[site={cfg.site_id} rank=0] pipeline plan: stages={num_stages} "
        f"replicas={cfg.num_replicas} schedule={cfg.schedule} microbatches={cfg.num_microbatches} "
        f"data_parallel={cfg.data_parallel if cfg.num_replicas > 1 else '-'} "
        f"units={list(units.names)} boundaries={list(plan.boundaries)} "
        f"entries={list(cut.entries[1:])} hand_first={cut.hand_first} "
        f"stage_times_s={[round(t, 6) for t in plan.stage_times]} "
        f"predicted_bottleneck_s={plan.bottleneck:.6f} lower_bound_s={plan.lower_bound:.6f}"
    )
    if cfg.cut_record:
        record_cut(cfg.cut_record, key, list(plan.boundaries))
    return StagePlan(cut=cut, partition=plan)


def _cut_key(model: nn.Module, units: Sequence[str]) -> dict[str, Any]:
    """What a kept cut is of: the units' names and a digest of the model's parameter names and
    shapes (a model of the same names but other sizes is cut afresh)."""
    shapes = [[name, list(p.shape)] for name, p in model.named_parameters()]
    digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
    return {"units": list(units), "model": digest}


def _recorded_plan(
    path: str, key: dict[str, Any], num_stages: int, costs: list[float], sizes: list[int]
) -> PartitionPlan | None:
    """The plan of the cut kept in ``path`` by an earlier start of the same model into as many
    stages; None: none kept, kept for another model or number of stages, or not a cut."""
    if not path:
        return None
    try:
        record = json.loads(Path(path).read_text())
        starts = [int(b) for b in record["boundaries"]]
        if {k: record.get(k) for k in key} != key or len(starts) != num_stages:
            return None
        plan = partition_at(costs, sizes, starts)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    log.info("[pipeline] cutting as the last start did (%s): stages start at %s", path, starts)
    return plan


def record_cut(path: str, key: dict[str, Any], boundaries: list[int]) -> None:
    """Keep the cut for the next start (written whole, then renamed into place)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({**key, "boundaries": boundaries}))
        os.replace(tmp, target)
    except OSError as exc:  # the site still runs; its next start cuts afresh
        log.warning("[pipeline] cannot keep the cut in %s: %s", path, exc)


class RankPipeline:
    """This rank's stages of the job, torch's schedule over them, and the inner step.

    ``job``: built on this rank by the job's factory; its model is cut here, in place.
    Collective: every rank constructs its own, creating every process group in the same order.
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
        forwards = [plan.stage(copy.deepcopy(model) if many else model, i) for i in self.indices]
        self.modules = [forward.model.to(device) for forward in forwards]
        self.scheduler = getattr(job, "scheduler", None)

        # Each stage's replicas combine their gradients as ``data_parallel`` says (see _wrap).
        self.data_parallel = cfg.data_parallel if self.dp_group is not None else "allreduce"
        self.stages = stages = [
            PipelineStage(
                _wrap(forward, self.data_parallel, self.dp_group, device),
                index,
                self.num_stages,
                device,
                group=self.pp_group,
            )
            for index, forward in zip(self.indices, forwards, strict=True)
        ]
        # After fully_shard, which replaces the parameters by sharded ones.
        self.optimizer = _keep_local_parameters(job.optimizer, name_of, self.modules)
        schedule_class = get_schedule_class(TORCH_SCHEDULES[cfg.schedule][0])
        self.schedule = schedule_class(
            stages if len(stages) > 1 else stages[0],
            n_microbatches=cfg.num_microbatches,
            loss_fn=job.output_loss,
            scale_grads=True,
        )

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's federated tensors, by full-model name: the live parameters and buffers
        (under FSDP a parameter is a ``DTensor`` holding this rank's shard)."""
        return {n: t for module in self.modules for n, t in federated_state(module).items()}

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
                whole = torch.as_tensor(named[name])
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
                shape = p.to_local().shape
                st = self.optimizer.state.get(p, {})
                for key, value in st.items():
                    # A state tensor the shape of the shard is the shard of a sharded one
                    # (AdamW's moments); a scalar (its step) stays as it is.
                    if isinstance(value, torch.Tensor) and value.dim() and value.shape == shape:
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
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.holds_last else {}
        # Sync off for the whole step, so that torch's stage alone arms DDP's reducer, before
        # the last backward (docs/pipelines.md: why the whole step runs under DDP's no_sync).
        with contextlib.ExitStack() as ddp_sync_off:
            for stage in self.stages:
                if isinstance(stage.submod, DistributedDataParallel):
                    ddp_sync_off.enter_context(stage.submod.no_sync())
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
        for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

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
    """``module`` as its replicas share it over ``dp_group`` under ``data_parallel`` (DDP,
    FSDP2's ``fully_shard``, or the plain module that ``RankPipeline`` all-reduces after the
    schedule; docs/pipelines.md); the ``PipelineStage`` gets what this returns."""
    if dp_group is None or data_parallel == "allreduce":
        return module
    if data_parallel == "ddp":
        # No device_ids: the stage's inputs are already on the rank's device. Buffers are not
        # broadcast at each forward: replicas start equal (same seed, and DDP broadcasts them
        # once here) and the allreduce mode does not sync them either.
        return DistributedDataParallel(module, process_group=dp_group, forward_sync_buffers=False)
    # Named after the group, as DTensor caches sharding decisions by mesh (docs/pipelines.md).
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


__all__ = ["PipelineConfig", "RankPipeline", "StagePlan", "make_stage_plan"]
