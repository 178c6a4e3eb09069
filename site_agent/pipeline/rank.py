"""One rank of a pipelined site of any job: its stages, its part in each command, the workers' loop.

Rank 0 checks, profiles and cuts the job and broadcasts the plan; each rank keeps its stages
(``engine.RankPipeline``). The leader (``leader.PipelineTrainer``) broadcasts each command, a
:class:`SiteRank` method and its arguments, and every rank runs it (docs/pipelines.md). With
``PipelineConfig.sync_shards`` each rank also syncs its own tensors (``stagesync.StageSync``):
the ``sync`` command is one of its calls.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from site_agent.allocator import return_large_blocks
from site_agent.batches import JobBatches, first_dimension, to_cpu, to_device
from site_agent.jobs.contract import (
    Job,
    StateSpec,
    check_metrics,
    check_pipeline_job,
    federated_state,
    state_spec,
)
from site_agent.jobs.contract import buffer_names as federated_buffer_names
from site_agent.pipeline.engine import PipelineConfig, RankPipeline, make_stage_plan
from site_agent.pipeline.stagesync import StageSync

log = logging.getLogger(__name__)

# Workers wait for the leader's next command as long as the leader spends between calls.
CONTROL_TIMEOUT = timedelta(days=7)


class StartRefused(ValueError):
    """On a worker: the leader refused the job or its cut (and says why itself)."""


class SiteRank:
    """What one rank holds. Each of ``COMMANDS`` is run by every rank together; its result is
    the leader's (``None`` on the workers)."""

    COMMANDS = frozenset(
        {
            "train",
            "gather_parameters",
            "load_parameters",
            "gather_state",
            "load_state",
            "evaluate_gathered",
            "sync",
        }
    )

    def __init__(
        self, job: Job, cfg: PipelineConfig, device: torch.device, *, where: str = "the job"
    ) -> None:
        """Collective. ``job``: built on this rank by the job's factory; ``where`` names it in
        the leader's errors."""
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized")
        layout = cfg.layout
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(
                f"the process group has {world} ranks but stages x replicas = "
                f"{layout.num_stages} x {layout.num_replicas}"
            )
        self.job, self.cfg, self.layout, self.rank, self.device = job, cfg, layout, rank, device
        self.where = where
        # FSDP gathers and frees a block's parameters at every step; a rank's syncs allocate
        # and free its rows: large blocks go back to the system (site_agent.allocator).
        return_large_blocks()
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        # A sync call's collectives wait no longer than a rank's local work can take.
        self.sync_group = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.rank_timeout_s))
            if cfg.sync_shards
            else None
        )
        model = job.model
        self.order = list(federated_state(model))
        self.spec: StateSpec = state_spec(model)
        self.buffers = federated_buffer_names(model)
        self._weight: Callable[[Any], int] = getattr(job, "weight", first_dimension)
        self.eval_model: nn.Module | None = None
        sample = self._draw_sample()
        box: list[Any] = [None]
        refusal: Exception | None = None
        if rank == 0:
            try:
                check_pipeline_job(job, sample, where)
                self.eval_model = copy.deepcopy(model).to("cpu")  # before the cut: validation
                box[0] = make_stage_plan(job, sample, cfg)
            except Exception as exc:  # the job's own code may raise anything: all ranks stop
                refusal = exc
                text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                box[0] = StartRefused(text)
        dist.broadcast_object_list(box, src=0, group=self.control)
        if isinstance(box[0], StartRefused):
            raise box[0] from refusal
        self.pipeline = RankPipeline(job, box[0], cfg, rank=rank, device=device)
        self.step = 0
        self.stage_sync: StageSync | None = None
        if cfg.sync_shards:
            self.stage_sync = StageSync(self, decay=cfg.error_feedback_decay)
        dist.barrier(group=self.control)

    def _draw_sample(self) -> Any:
        """One batch to check and profile the job on; every rank draws it, so all stay in
        lockstep even without a job state to put back."""
        job = self.job
        saved = copy.deepcopy(job.state_dict()) if hasattr(job, "state_dict") else None
        sample = to_device(next(JobBatches(job, self.where)), self.device)
        if saved is not None:
            job.load_state_dict(saved)  # type: ignore[attr-defined]
        self._batches = JobBatches(job, self.where)
        return sample

    def run(self, command: tuple[Any, ...]) -> Any:
        """Carry out ``(name, *args)``, a command the leader broadcast."""
        name, *args = command
        assert name in self.COMMANDS, f"unknown command {name!r}"
        return getattr(self, name)(*args)

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

    def gather_parameters(self) -> dict[str, np.ndarray] | None:
        """Replica 0's stages send their federated tensors to the leader, by name (under FSDP
        every replica takes part in gathering the shards)."""
        whole = self.pipeline.full_state()
        own = None
        if self.layout.replica_of(self.rank) == 0:
            own = {
                n: t.detach().to("cpu", torch.float32, copy=True).numpy() for n, t in whole.items()
            }
        parts = self._gather(own)
        if parts is None:
            return None
        merged = {n: a for part in parts if part for n, a in part.items()}
        return {n: merged[n] for n in self.order}

    def load_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Copy in the federated tensors this rank holds; the optimizer state is kept."""
        self.pipeline.load_state(params)

    def gather_state(self) -> dict[str, Any] | None:
        """The site's checkpoint, on the leader: every rank's share, the layout it was taken
        under, the whole model by name, the step and the job's state (docs/pipelines.md)."""
        pipeline = self.pipeline
        scheduler = pipeline.scheduler
        parts = self._gather(
            {
                "model": to_cpu({n: t.detach() for n, t in pipeline.full_state().items()}),
                "optimizer": to_cpu(pipeline.optimizer_state()),
                "scheduler": to_cpu(scheduler.state_dict()) if scheduler is not None else None,
            }
        )
        if parts is None:
            return None
        replica_0 = parts[: self.layout.num_stages]
        whole = {n: t for part in replica_0 for n, t in part["model"].items()}
        state: dict[str, Any] = {
            "layout": self._layout_key(),
            "ranks": parts,
            "model": {n: whole[n] for n in self.order},
            "step": self.step,
        }
        if hasattr(self.job, "state_dict"):
            state["job"] = to_cpu(self.job.state_dict())
        return state

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Every rank loads its share under the same layout (FSDP shards under FSDP only); under
        another, or from a single-process checkpoint, the model by name (docs/pipelines.md)."""
        self.pipeline.load_state(state["model"])
        if self._same_layout(list(state.get("layout", []))):
            self._load_share(state["ranks"][self.rank])
        if "job" in state and hasattr(self.job, "load_state_dict"):
            self.job.load_state_dict(state["job"])
        self._batches = JobBatches(self.job, self.where)
        self.step = int(state["step"])

    def sync(self, method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """Make sync call ``method`` of this rank's ``StageSync`` (the leader makes it too)."""
        assert self.stage_sync is not None, "the site syncs through its leader"
        return getattr(self.stage_sync, method)(*args, **kwargs)

    def evaluate_gathered(self) -> dict[str, float] | None:
        """The job's ``evaluate`` of the federated tensors as the ranks hold them now, on the
        leader's copy of the whole model (every rank takes part: the tensors are gathered to
        it); the metrics on the leader, None elsewhere."""
        params = self.gather_parameters()
        if params is None:
            return None
        model = self.eval_model
        assert model is not None, "rank 0 keeps the model for validation"
        model.eval()
        with torch.no_grad():
            for name, tensor in federated_state(model).items():
                tensor.copy_(torch.as_tensor(params[name]))
            metrics = self.job.evaluate(model)
        return check_metrics(metrics, self.where, finite_loss=False)

    def training_state(self) -> dict[str, Any]:
        """This rank's training state besides the federated tensors: its optimizer and
        scheduler (its shards under FSDP), the step, the job's state and the layout."""
        scheduler = self.pipeline.scheduler
        state: dict[str, Any] = {
            "layout": self._layout_key(),
            "optimizer": to_cpu(self.pipeline.optimizer_state()),
            "scheduler": to_cpu(scheduler.state_dict()) if scheduler is not None else None,
            "step": self.step,
        }
        if hasattr(self.job, "state_dict"):
            state["job"] = to_cpu(self.job.state_dict())
        return state

    def load_training_state(
        self, own: Mapping[str, Any] | None, *, leader: Mapping[str, Any] | None
    ) -> None:
        """What :meth:`training_state` gave on this rank (``own``: its optimizer and scheduler
        are loaded under the same layout only) and on the leader (its step and job state, which
        every rank shares)."""
        if own is not None and self._same_layout(own.get("layout", [])):
            self._load_share(own)
        common = leader if leader is not None else own
        if common is None:
            return
        if "job" in common and hasattr(self.job, "load_state_dict"):
            self.job.load_state_dict(common["job"])
        self._batches = JobBatches(self.job, self.where)
        self.step = int(common["step"])

    def _same_layout(self, taken: list[Any]) -> bool:
        """Whether a rank's optimizer state written under ``taken`` fits this rank's stages:
        the same stages, replicas and schedule, FSDP or not alike, and the same cut of the
        model into stages where the checkpoint records it (the cut follows measured step
        times, so a restart may cut differently: its optimizer then starts afresh, θ still
        resumes)."""
        key, taken = self._layout_key(), list(taken)
        sharded = taken[3:4] == ["fsdp"]
        same_cut = len(taken) <= 4 or taken[4:] == key[4:]
        same = taken[:3] == key[:3] and sharded == (key[3] == "fsdp") and same_cut
        if taken and not same and self.rank == 0:
            log.warning(
                "[site rank=0] the checkpoint was written under layout %s, this run is %s: "
                "the model resumes, the ranks' optimizer state starts afresh",
                taken,
                key,
            )
        return same

    def _load_share(self, share: Mapping[str, Any]) -> None:
        pipeline = self.pipeline
        pipeline.load_optimizer_state(share["optimizer"])
        if pipeline.scheduler is not None and share["scheduler"] is not None:
            pipeline.scheduler.load_state_dict(share["scheduler"])

    def _layout_key(self) -> list[Any]:
        layout, cfg = self.layout, self.cfg
        cut = [int(b) for b in self.pipeline.plan.partition.boundaries]
        return [
            layout.num_stages,
            layout.num_replicas,
            cfg.schedule,
            self.pipeline.data_parallel,
            cut,
        ]

    def _gather(self, share: Any) -> list[Any] | None:
        """Every rank's ``share`` (index = rank) on the leader; ``None`` elsewhere."""
        parts: list[Any] | None = [None] * self.layout.world_size if self.rank == 0 else None
        dist.gather_object(share, parts, dst=0, group=self.control)
        return parts


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


def broadcast_command(command: tuple[Any, ...], control: dist.ProcessGroup) -> None:
    """The leader's side: send ``(name, *args)`` (or ``("stop",)``) to every rank."""
    dist.broadcast_object_list([command], src=0, group=control)


def worker_loop(job: Job, cfg: PipelineConfig, device: torch.device) -> None:
    """Every rank but 0: set up this rank's stages of ``job``, then carry out the leader's
    commands until it closes its ``PipelineTrainer``."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        raise ValueError("worker_loop runs on ranks other than 0")
    rank = SiteRank(job, cfg, device)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=rank.control)
        if box[0][0] == "stop":
            return
        rank.run(box[0])


__all__ = ["SiteRank", "StartRefused", "broadcast_command", "worker_loop"]
