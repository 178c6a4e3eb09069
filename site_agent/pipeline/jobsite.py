"""A pipelined site of any job: the leader's trainer and the workers' loop over ``engine``.

This module owns how the ranks of a site that pipelines a job (``site_agent.jobs.contract``:
``split``, ``output_loss``) carry out the leader's commands. Every rank builds the job with its
factory (same seed, so every stage starts from the single-process weights), rank 0 profiles and
cuts it and broadcasts the plan, and each rank keeps its stages (``engine.RankPipeline``).
Rank 0 holds a ``jobleader.JobPipelineTrainer``, the agent's trainer surface (``train_steps``,
``validate``, ``parameters_numpy``, ``load_parameters``, ``state_spec``, ``fingerprint``,
``state_dict``, ``load_state_dict``); every other rank runs :func:`job_worker_loop`. Each call
broadcasts a command on a gloo control group (``worker.broadcast_command``) and all ranks carry
it out together; only rank 0 ever talks to the coordinator.

Data: every rank draws the job's batches in lockstep (the same seed); each batch is the site's
global batch of one inner step, and replica r trains on its r-th share along the first
dimension, cut into micro-batches by torch's schedule. So a site's step is one process's step
on the same batch, to float rounding, whatever its layout.

Validation: rank 0 keeps an unstripped copy of the model on the CPU for the job's ``evaluate``,
loaded with the gathered state before each call (the job's metrics need its whole model).

Checkpoints: ``state_dict`` holds every rank's share (``ranks``: its stages' tensors, optimizer,
scheduler) with the ``layout`` it was taken under (stages, replicas, schedule, data parallelism),
the whole model by name (``model``), the step and the job's own state. Under the same layout
every rank gets its share back; under another the model is loaded by name and the inner
optimizer starts afresh. Under FSDP a rank's optimizer share is its shards, so only FSDP loads
it back; DDP and the all-reduce hold the same whole tensors and load each other's.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from site_agent.jobs.contract import (
    JobContext,
    StateSpec,
    build_job,
    check_pipeline_job,
    federated_state,
    state_spec,
)
from site_agent.jobs.contract import buffer_names as federated_buffer_names
from site_agent.pipeline.engine import (
    RankPipeline,
    StagePlan,
    check_data_parallel,
    make_stage_plan,
    stages_per_rank,
)
from site_agent.pipeline.stage import PipelineLayout
from site_agent.pipeline.worker import receive_command
from site_agent.trainer import _to_cpu, first_dimension, to_device

log = logging.getLogger(__name__)

# Workers wait for the leader's next command as long as the leader spends between calls.
CONTROL_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True, kw_only=True)
class JobSiteConfig:
    """What every rank of a pipelined job site agrees on; all ranks get the same one."""

    factory: str
    """The job's factory, ``package.module:callable``."""
    python_path: tuple[str, ...] = ()
    """Prepended to ``sys.path`` before the factory is imported."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """``[site.job.options]``."""
    seed: int = 0
    """The federation's seed."""
    site_id: str = "site"
    """Shown in log lines."""
    state_dir: str = "."
    """The site's directory."""
    num_stages: int = 2
    """Pipeline ranks per replica."""
    num_replicas: int = 1
    """Data-parallel copies of the pipeline."""
    data_parallel: str = "ddp"
    """How a stage's replicas combine gradients: ``ddp``, ``fsdp`` or ``allreduce``
    (``engine.check_data_parallel`` says which schedules each runs)."""
    num_microbatches: int = 4
    """Micro-batches per replica and inner step."""
    schedule: str = "1f1b"
    """One of ``engine.TORCH_SCHEDULES``."""
    grad_clip: float = 1.0
    """Largest global gradient norm (0: off)."""
    profile_steps: int = 3
    """Timed passes of the per-unit profile."""

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_replicas", "num_microbatches", "profile_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        stages_per_rank(self.schedule)
        check_data_parallel(self.data_parallel, self.schedule, self.num_replicas)

    @property
    def layout(self) -> PipelineLayout:
        return PipelineLayout(num_stages=self.num_stages, num_replicas=self.num_replicas)


class JobRank:
    """What one rank holds and does; every command method is called on all ranks together."""

    def __init__(self, cfg: JobSiteConfig, device: torch.device) -> None:
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized")
        layout = cfg.layout
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(
                f"the process group has {world} ranks but stages x replicas = "
                f"{layout.num_stages} x {layout.num_replicas}"
            )
        self.cfg, self.layout, self.rank, self.device = cfg, layout, rank, device
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        context = JobContext(
            site_id=cfg.site_id,
            seed=cfg.seed,
            device=device,
            options=cfg.options,
            rank=rank,
            world_size=world,
            state_dir=Path(cfg.state_dir),
        )
        where = f"the job from {cfg.factory!r}"
        self.job = build_job(cfg.factory, context, cfg.python_path)
        model = self.job.model
        self.order = list(federated_state(model))
        self.spec: StateSpec = state_spec(model)
        self.buffers = federated_buffer_names(model)
        self.architecture = getattr(self.job, "architecture", None)
        self._weight: Callable[[Any], int] = getattr(self.job, "weight", first_dimension)
        self.eval_model: nn.Module | None = None
        sample = self._draw_sample()
        box: list[Any] = [self._make_plan(sample, where) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        self.plan: StagePlan = box[0]
        # Group creation is collective over the whole world, in the same order on every rank.
        pp_groups = [dist.new_group(layout.replica_ranks(r)) for r in range(layout.num_replicas)]
        dp_groups = (
            [dist.new_group(layout.stage_ranks(s)) for s in range(layout.num_stages)]
            if layout.num_replicas > 1
            else None
        )
        self.pipeline = RankPipeline(
            job=self.job,
            plan=self.plan,
            schedule=cfg.schedule,
            num_microbatches=cfg.num_microbatches,
            layout=layout,
            rank=rank,
            device=device,
            pp_group=pp_groups[layout.replica_of(rank)],
            dp_group=dp_groups[layout.stage_of(rank)] if dp_groups else None,
            grad_clip=cfg.grad_clip,
            data_parallel=cfg.data_parallel,
        )
        self.step = 0
        dist.barrier(group=self.control)

    def _draw_sample(self) -> Any:
        """One batch to check and profile the job on; every rank draws it, so all stay in
        lockstep even without a job state to put back."""
        job = self.job
        saved = copy.deepcopy(job.state_dict()) if hasattr(job, "state_dict") else None
        sample = to_device(next(iter(job.batches())), self.device)
        if saved is not None:
            job.load_state_dict(saved)  # type: ignore[attr-defined]
        self._batches = iter(job.batches())
        return sample

    def _make_plan(self, sample: Any, where: str) -> StagePlan:
        """The leader's part: check the job, keep a copy for validation, profile and cut."""
        cfg = self.cfg
        check_pipeline_job(self.job, sample, where)
        self.eval_model = copy.deepcopy(self.job.model).to("cpu")
        num_stages = cfg.num_stages * stages_per_rank(cfg.schedule)
        plan = make_stage_plan(
            self.job,
            sample,
            num_stages,
            num_microbatches=cfg.num_microbatches * cfg.num_replicas,
            profile_steps=cfg.profile_steps,
        )
        p = plan.partition
        log.info(
            "[site=%s rank=0] pipeline plan: stages=%d replicas=%d schedule=%s "
            "microbatches=%d data_parallel=%s units=%s boundaries=%s stage_times_s=%s "
            "predicted_bottleneck_s=%.6f lower_bound_s=%.6f",
            cfg.site_id,
            num_stages,
            cfg.num_replicas,
            cfg.schedule,
            cfg.num_microbatches,
            cfg.data_parallel if cfg.num_replicas > 1 else "-",
            list(plan.units.names),
            list(p.boundaries),
            [round(t, 6) for t in p.stage_times],
            p.bottleneck,
            p.lower_bound,
        )
        return plan

    # -- commands --------------------------------------------------------------------------

    def train(self, num_steps: int) -> tuple[torch.Tensor, int]:
        """``num_steps`` inner steps; returns (the site's loss per step, its weight)."""
        replica, replicas = self.layout.replica_of(self.rank), self.layout.num_replicas
        losses: list[torch.Tensor] = []
        weight = 0
        for _ in range(num_steps):
            batch = to_device(next(self._batches), self.device)
            weight += int(self._weight(batch))
            loss = self.pipeline.train_step(_share(batch, replica, replicas))
            if loss is not None:
                losses.append(loss)
            self.step += 1
        per_step = torch.zeros(num_steps, dtype=torch.float64)
        if losses:
            per_step = torch.stack(losses).double().cpu() / replicas
        dist.all_reduce(per_step, op=dist.ReduceOp.SUM, group=self.control)
        return per_step, weight

    def gather(self) -> dict[str, np.ndarray] | None:
        """Replica 0's stages send their federated tensors to the leader, by name (under FSDP
        every replica takes part in gathering the shards)."""
        whole = self.pipeline.full_state()
        own = None
        if self.layout.replica_of(self.rank) == 0:
            own = {
                n: t.detach().to("cpu", torch.float32, copy=True).numpy() for n, t in whole.items()
            }
        parts: list[Any] | None = [None] * self.layout.world_size if self.rank == 0 else None
        dist.gather_object(own, parts, dst=0, group=self.control)
        if parts is None:
            return None
        merged: dict[str, np.ndarray] = {}
        for part in parts:
            merged.update(part or {})
        return {n: merged[n] for n in self.order}

    def scatter(self, params: Mapping[str, np.ndarray] | None = None) -> None:
        """The leader sends the federated tensors; every rank copies in those it holds."""
        box: list[Any] = [dict(params) if params is not None else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        self.pipeline.load_state(box[0])

    def gather_state(self) -> dict[str, Any] | None:
        """Every rank's share of a checkpoint, and the whole model by name, on the leader."""
        pipeline = self.pipeline
        share = {
            "model": _to_cpu({n: t.detach() for n, t in pipeline.full_state().items()}),
            "optimizer": _to_cpu(pipeline.optimizer_state()),
            "scheduler": _to_cpu(pipeline.scheduler.state_dict())
            if pipeline.scheduler is not None
            else None,
        }
        parts: list[Any] | None = [None] * self.layout.world_size if self.rank == 0 else None
        dist.gather_object(share, parts, dst=0, group=self.control)
        if parts is None:
            return None
        whole: dict[str, Any] = {}
        for part in parts[: self.layout.num_stages]:  # replica 0
            whole.update(part["model"])
        state: dict[str, Any] = {
            "layout": [*self._layout_key(), pipeline.data_parallel],
            "ranks": parts,
            "model": {n: whole[n] for n in self.order},
            "step": self.step,
        }
        if hasattr(self.job, "state_dict"):
            state["job"] = _to_cpu(self.job.state_dict())
        return state

    def _layout_key(self) -> list[Any]:
        return [self.layout.num_stages, self.layout.num_replicas, self.cfg.schedule]

    def scatter_state(self, state: Mapping[str, Any] | None = None) -> None:
        """Every rank loads its share (same layout) or the model by name (another one)."""
        box: list[Any] = [None]
        if self.rank == 0:
            assert state is not None
            box[0] = state
        dist.broadcast_object_list(box, src=0, group=self.control)
        state = box[0]
        assert state is not None
        pipeline = self.pipeline
        # The optimizer's state is per rank; under FSDP it is this rank's shards, so a
        # checkpoint taken with or without FSDP loads the other way by name only. (One from
        # before data_parallel has three entries: its ranks held whole tensors.)
        taken = list(state.get("layout", []))
        taken_dp = taken[3] if len(taken) > 3 else "allreduce"
        same = taken[:3] == self._layout_key() and (taken_dp == "fsdp") == (
            pipeline.data_parallel == "fsdp"
        )
        pipeline.load_state(state["model"])
        if same:
            share = state["ranks"][self.rank]
            pipeline.load_optimizer_state(share["optimizer"])
            if pipeline.scheduler is not None and share["scheduler"] is not None:
                pipeline.scheduler.load_state_dict(share["scheduler"])
        if "job" in state and hasattr(self.job, "load_state_dict"):
            self.job.load_state_dict(state["job"])
        self._batches = iter(self.job.batches())
        self.step = int(state["step"])


def _share(batch: Any, replica: int, replicas: int) -> Any:
    """Replica ``replica``'s share of every tensor of ``batch`` along its first dimension."""
    if replicas == 1:
        return batch
    if isinstance(batch, torch.Tensor):
        n = batch.shape[0] // replicas
        return batch[replica * n : (replica + 1) * n]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_share(b, replica, replicas) for b in batch)
    if isinstance(batch, Mapping):
        return {k: _share(v, replica, replicas) for k, v in batch.items()}
    return batch


def job_worker_loop(cfg: JobSiteConfig, device: torch.device) -> None:
    """Every rank but 0: set up this rank's stages, then carry out the leader's commands until
    it closes its :class:`JobPipelineTrainer`."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        raise ValueError("job_worker_loop runs on ranks other than 0")
    r = JobRank(cfg, device)
    while True:
        command = receive_command(r.control)
        name = command[0]
        if name == "stop":
            return
        if name == "train":
            r.train(command[1])
        elif name == "params":
            r.gather()
        elif name == "load_params":
            r.scatter()
        elif name == "state":
            r.gather_state()
        elif name == "load_state":
            r.scatter_state()
        else:
            raise AssertionError(f"unknown command {name!r}")


__all__ = ["JobRank", "JobSiteConfig", "job_worker_loop"]
