"""A site's pipelined trainer across its torchrun ranks: layout, commands, gather and scatter.

This module owns how the ranks of one site work together. The site leader (rank 0) holds a
``PipelineTrainer``, which offers the same surface as ``LocalTrainer`` (``train_steps``,
``evaluate``, ``parameters_numpy``, ``load_parameters``, ``state_dict``, ``load_state_dict``,
``step``), so the site agent drives either without knowing which. Every other rank runs
``worker_loop``. For each call the leader broadcasts a small command on a gloo control group and all
ranks carry it out together; a worker does nothing between commands.

Layout: ``num_stages x num_replicas`` ranks, rank = ``replica * num_stages + stage``
(``PipelineLayout``). Stage 0 of replica 0 is the leader. Each replica is one pipeline; the ranks
holding the same stage in every replica form that stage's data-parallel group.

Setup (``PipelineTrainer.start`` on rank 0 and ``worker_loop`` elsewhere, collectively): every rank
builds the full model from ``(model config, model_seed)`` on the CPU, so initial weights agree
without a transfer; the leader profiles the real layers on a sample micro-batch
(``profile_layers``), cuts the chain with ``partition_layers`` and broadcasts the plan; each rank
keeps its stage's layers and drops the rest.

Data: the inner step's batch (``InnerOptimConfig.batch_size`` sequences, the site's whole step)
is split evenly over the replicas, and each replica's share into ``num_microbatches``
micro-batches. Replica r samples its own data from ``replica_seed(data_seed, r, num_replicas)``.
Stage 0 needs the tokens and the last stage the targets of the same batch: both hold a sampler
with that seed and draw in lockstep, so no targets travel between stages.

Outer sync: ``parameters_numpy`` gathers every stage's parameters (from replica 0; replicas are
equal after every step) into one dict with the single-process ``ByteGPT.state_dict()`` names and
order; ``load_parameters`` sends every rank of every replica its stage's slice.
``state_dict`` has ``LocalTrainer``'s format (full-model names, the optimizer state indexed as a
single-process AdamW would index it) plus every replica's sampler, so a checkpoint restores under
any stage count, and a one-replica checkpoint moves between the two trainers.

``LocalProcessGroup`` runs functions in spawned CPU processes joined in a gloo group, for tests
and benchmarks on one machine.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from site_agent.data import BatchSampler, ByteCorpus
from site_agent.model import ModelConfig, build_model, param_spec
from site_agent.pipeline.executor import (
    P2P_MODES,
    PipelineLayout,
    StageExecutor,
    StepTrace,
    adamw_param_names,
    flatten,
    slice_stage,
    unflatten,
)
from site_agent.pipeline.partition import (
    PartitionPlan,
    TransferModel,
    partition_layers,
    profile_layers,
)
from site_agent.pipeline.schedule import SCHEDULES, make_schedule
from site_agent.trainer import InnerOptimConfig, TrainStats, _to_cpu

log = logging.getLogger(__name__)

# Workers wait for the leader's next command for as long as the leader spends between calls
# (an outer sync over the WAN can take many minutes), so the control group never times out first.
CONTROL_TIMEOUT = timedelta(days=7)

_TAG_TARGETS = 7  # evaluation targets from the leader to the last stage


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


# -- process group ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the site's process group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def init_from_torchrun_env(*, timeout: timedelta = timedelta(minutes=30)) -> DistEnv:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``): NCCL on ``cuda:LOCAL_RANK`` when CUDA is available, else
    gloo on the CPU. ``timeout`` bounds the training collectives, not the wait for commands.

    Uses ``env://`` so that under torchrun the ranks join the launcher's own store rather than
    starting a second one on ``MASTER_PORT``.
    """
    missing = [
        k
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        if k not in os.environ
    ]
    if missing:
        raise ValueError(f"not started by torchrun: {', '.join(missing)} unset")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl",
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device,
        )
        return DistEnv(rank, world_size, local_rank, device, "nccl")
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=world_size, timeout=timeout
    )
    return DistEnv(rank, world_size, local_rank, torch.device("cpu"), "gloo")


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- one rank's share ------------------------------------------------------------------------


@dataclass(frozen=True)
class _StageSpec:
    """Names, shapes and optimizer order of one stage's parameters (known on every rank)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    optim_names: tuple[str, ...]

    @property
    def numel(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)


class _Rank:
    """What one rank holds and does; every command method is called on all ranks together."""

    def __init__(
        self,
        *,
        job: PipelineJob,
        rank: int,
        device: torch.device,
        plan: PartitionPlan,
        executor: StageExecutor,
        sampler: BatchSampler | None,
        control: dist.ProcessGroup,
        full_spec: list[tuple[str, tuple[int, ...]]],
        full_optim_names: list[str],
        stage_specs: list[_StageSpec],
    ) -> None:
        self.job = job
        self.layout = job.layout
        self.rank = rank
        self.stage = self.layout.stage_of(rank)
        self.replica = self.layout.replica_of(rank)
        self.device = device
        self.plan = plan
        self.executor = executor
        self.module = executor.module
        self.sampler = sampler
        self.control = control
        self.full_spec = full_spec
        self.full_optim_names = full_optim_names
        self.stage_specs = stage_specs
        self.step = 0
        self.num_microbatches = job.pipeline.num_microbatches
        self.activation_shape = (job.microbatch_size, job.model.context_len, job.model.d_model)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.layout.num_stages - 1

    # -- commands --------------------------------------------------------------------------

    def train(self, num_steps: int) -> torch.Tensor:
        """``num_steps`` inner steps; returns the site's loss per step (every rank gets it)."""
        losses: list[torch.Tensor] = []
        m = self.num_microbatches
        for _ in range(num_steps):
            inputs = targets = None
            if self.sampler is not None:
                x, y = self.sampler.next_batch()
                if self.is_first:
                    inputs = [c.to(self.device) for c in x.chunk(m)]
                if self.is_last:
                    targets = [c.to(self.device) for c in y.chunk(m)]
            loss = self.executor.train_step(
                step=self.step,
                inputs=inputs,
                targets=targets,
                activation_shape=self.activation_shape,
            )
            if loss is not None:
                losses.append(loss)
            self.step += 1
        per_step = torch.zeros(num_steps, dtype=torch.float64)
        if losses:
            # One host sync per call: the last stages' losses, averaged over the replicas.
            per_step = torch.stack(losses).double().cpu() / self.layout.num_replicas
        dist.all_reduce(per_step, op=dist.ReduceOp.SUM, group=self.control)
        return per_step

    def evaluate(
        self,
        shapes: Sequence[tuple[int, int]],
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> float | None:
        """Replica 0 runs the batches forward; returns the mean loss on the leader."""
        if self.replica != 0:
            return None
        num_stages = self.layout.num_stages
        last_rank = self.layout.rank(stage=num_stages - 1, replica=0)
        inputs: list[torch.Tensor] | None = None
        targets: list[torch.Tensor] | None = None
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        if self.rank == 0:
            assert batches is not None
            inputs = [x.to(self.device) for x, _ in batches]
            ys = [y.to(self.device) for _, y in batches]
            if num_stages == 1:
                targets = ys
            else:
                for y in ys:
                    work = dist.isend(y, dst=last_rank, tag=_TAG_TARGETS)
                    assert work is not None
                    sends.append((work, y))
        if self.is_last and num_stages > 1:
            targets = []
            for shape in shapes:
                y = torch.empty(shape, dtype=torch.int64, device=self.device)
                dist.recv(y, src=0, tag=_TAG_TARGETS)
                targets.append(y)
        d_model = self.job.model.d_model
        total = self.executor.forward_only(
            inputs=inputs,
            targets=targets,
            activation_shapes=[(*s, d_model) for s in shapes],
        )
        for work, _ in sends:
            work.wait()
        if num_stages == 1:
            assert total is not None
            return float(total.cpu()) / len(shapes)
        if self.is_last:
            assert total is not None
            dist.send(total, dst=0)
        if self.rank == 0:
            received = torch.zeros((), dtype=torch.float64, device=self.device)
            dist.recv(received, src=last_rank)
            return float(received.cpu()) / len(shapes)
        return None

    def gather_parameters(self) -> dict[str, np.ndarray] | None:
        """Replica 0's stages send their parameters to the leader, which returns them all."""
        if self.replica != 0:
            return None
        own = flatten(list(self.module.state_dict().values())).to(self.device)
        if self.rank != 0:
            dist.send(own, dst=0)
            return None
        flats = [own]
        works = []
        for s in range(1, self.layout.num_stages):
            buf = torch.empty(self.stage_specs[s].numel, dtype=torch.float32, device=self.device)
            work = dist.irecv(buf, src=self.layout.rank(stage=s, replica=0))
            assert work is not None
            works.append(work)
            flats.append(buf)
        for work in works:
            work.wait()
        params: dict[str, np.ndarray] = {}
        for spec, flat in zip(self.stage_specs, flats, strict=True):
            cpu = flat.to("cpu")
            offset = 0
            for name, shape in zip(spec.names, spec.shapes, strict=True):
                n = int(np.prod(shape))
                params[name] = cpu[offset : offset + n].view(shape).numpy()
                offset += n
        return params

    def scatter_parameters(self, flats: Sequence[torch.Tensor] | None = None) -> None:
        """The leader sends each rank its stage's flat parameters; every rank copies them in."""
        if self.rank == 0:
            assert flats is not None
            on_device = [f.to(self.device) for f in flats]
            works = []
            for r in range(1, self.layout.world_size):
                work = dist.isend(on_device[self.layout.stage_of(r)], dst=r)
                assert work is not None
                works.append(work)
            own = on_device[0]
            for work in works:
                work.wait()
        else:
            own = torch.empty(self.stage_specs[self.stage].numel, device=self.device)
            dist.recv(own, src=0)
        tensors = list(self.module.state_dict().values())
        with torch.no_grad():
            for tensor, value in zip(tensors, unflatten(own, tensors), strict=True):
                tensor.copy_(value)

    def gather_state(self) -> dict[str, Any] | None:
        """Model and optimizer state of replica 0's stages and every replica's sampler."""
        optimizer = self.executor.optimizer
        payload: dict[str, Any] = {"model": None, "optimizer": None, "sampler": None}
        if self.replica == 0:
            state = optimizer.state_dict()
            names = self.stage_specs[self.stage].optim_names
            payload["model"] = _to_cpu(self.module.state_dict())
            payload["optimizer"] = {
                "state": {names[idx]: _to_cpu(s) for idx, s in state["state"].items()},
                "hparams": [
                    {k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]
                ],
            }
        if self.is_first and self.sampler is not None:
            payload["sampler"] = self.sampler.state_dict()
        gathered: list[Any] | None = [None] * self.layout.world_size if self.rank == 0 else None
        dist.gather_object(payload, gathered, dst=0, group=self.control)
        if gathered is None:
            return None
        layout = self.layout
        model: dict[str, torch.Tensor] = {}
        by_name: dict[str, Any] = {}
        for s in range(layout.num_stages):
            part = gathered[layout.rank(stage=s, replica=0)]
            model.update(part["model"])
            by_name.update(part["optimizer"]["state"])
        assert list(model) == [name for name, _ in self.full_spec]
        hparams = gathered[0]["optimizer"]["hparams"]
        num_decay = sum(1 for name, shape in self.full_spec if len(shape) >= 2)
        index_ranges = [range(num_decay), range(num_decay, len(self.full_optim_names))]
        samplers = [
            gathered[layout.rank(stage=0, replica=r)]["sampler"] for r in range(layout.num_replicas)
        ]
        return {
            "model": model,
            "optimizer": {
                "state": {
                    idx: by_name[name]
                    for idx, name in enumerate(self.full_optim_names)
                    if name in by_name
                },
                "param_groups": [
                    {**hp, "params": list(ix)} for hp, ix in zip(hparams, index_ranges, strict=True)
                ],
            },
            "sampler": samplers[0],
            "replica_samplers": samplers,
            "step": self.step,
        }

    def scatter_state(self, payloads: Sequence[dict[str, Any]] | None = None) -> None:
        """The leader sends each rank its share of a checkpoint; every rank loads it."""
        received: list[Any] = [None]
        dist.scatter_object_list(
            received, list(payloads) if payloads else None, src=0, group=self.control
        )
        part = received[0]
        self.module.load_state_dict(part["model"])
        self.executor.optimizer.load_state_dict(part["optimizer"])
        if self.sampler is not None:
            self.sampler.load_state_dict(part["sampler"])
        self.step = int(part["step"])

    def gather_traces(self) -> list[StepTrace] | None:
        gathered: list[Any] | None = [None] * self.layout.world_size if self.rank == 0 else None
        dist.gather_object(self.executor.last_trace, gathered, dst=0, group=self.control)
        return gathered

    def probe_transfer(self, rounds: int) -> float | None:
        """Median one-way time of an activation between stages 0 and 1 of replica 0."""
        if self.layout.num_stages == 1 or self.replica != 0 or self.stage > 1:
            return 0.0 if self.rank == 0 else None
        buf = torch.zeros(self.activation_shape, device=self.device)
        times = []
        for k in range(rounds + 1):  # round 0 warms the connection up
            start = time.perf_counter()
            if self.stage == 0:
                dist.send(buf, dst=1)
                dist.recv(buf, src=1)
            else:
                dist.recv(buf, src=0)
                dist.send(buf, dst=0)
            if k > 0:
                times.append((time.perf_counter() - start) / 2)
        return statistics.median(times) if self.rank == 0 else None


def _setup_rank(job: PipelineJob, corpus: ByteCorpus, device: torch.device | None) -> _Rank:
    """Collective: every rank of the site calls it with the same ``job``."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: call init_from_torchrun_env()")
    layout = job.layout
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != layout.world_size:
        raise ValueError(
            f"the process group has {world_size} ranks but pipeline.num_stages x "
            f"pipeline.num_replicas = {layout.num_stages} x {layout.num_replicas} = "
            f"{layout.world_size}"
        )
    device = torch.device(device) if device is not None else _default_device()
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    assert control is not None

    model = build_model(job.model, seed=job.model_seed)
    chain = list(model.layers)
    full_spec = param_spec(model)
    full_optim_names = adamw_param_names(model)
    box: list[Any] = [None]
    if rank == 0:
        box[0] = _make_plan(job, chain, device)
    dist.broadcast_object_list(box, src=0, group=control)
    plan: PartitionPlan = box[0]

    stage, replica = layout.stage_of(rank), layout.replica_of(rank)
    stage_specs = []
    for layers in plan.stages:
        stage_module = slice_stage(chain, layers)
        named = list(stage_module.state_dict().items())
        stage_specs.append(
            _StageSpec(
                names=tuple(n for n, _ in named),
                shapes=tuple(tuple(t.shape) for _, t in named),
                optim_names=tuple(adamw_param_names(stage_module)),
            )
        )
    assert [n for spec in stage_specs for n in spec.names] == [n for n, _ in full_spec]
    module = slice_stage(chain, plan.stages[stage]).to(device)
    del model, chain

    # Group creation is collective over the whole world, in the same order on every rank.
    dp_groups = (
        [dist.new_group(layout.stage_ranks(s)) for s in range(layout.num_stages)]
        if layout.num_replicas > 1
        else None
    )
    pp_groups = (
        [dist.new_group(layout.replica_ranks(r)) for r in range(layout.num_replicas)]
        if layout.num_stages > 1
        else None
    )
    pipe = job.pipeline
    executor = StageExecutor(
        module=module,
        stage=stage,
        replica=replica,
        layout=layout,
        schedule=make_schedule(pipe.schedule, pipe.num_stages, pipe.num_microbatches),
        num_microbatches=pipe.num_microbatches,
        optim_cfg=job.optim,
        device=device,
        dp_group=dp_groups[stage] if dp_groups else None,
        pp_group=pp_groups[replica] if pp_groups else None,
        sync_timing=pipe.sync_timing,
        p2p=pipe.p2p,
    )
    sampler = None
    if stage in (0, layout.num_stages - 1):
        sampler = BatchSampler(
            corpus,
            batch_size=job.optim.batch_size // layout.num_replicas,
            context_len=job.model.context_len,
            seed=replica_seed(job.data_seed, replica, layout.num_replicas),
        )
    dist.barrier(group=control)
    return _Rank(
        job=job,
        rank=rank,
        device=device,
        plan=plan,
        executor=executor,
        sampler=sampler,
        control=control,
        full_spec=full_spec,
        full_optim_names=full_optim_names,
        stage_specs=stage_specs,
    )


def _make_plan(
    job: PipelineJob, chain: list[torch.nn.Module], device: torch.device
) -> PartitionPlan:
    """Profile the chain on one sample micro-batch and cut it (or apply fixed boundaries)."""
    pipe = job.pipeline
    generator = torch.Generator().manual_seed(job.model_seed)
    sample = torch.randint(
        0,
        job.model.vocab_size,
        (job.microbatch_size, job.model.context_len),
        generator=generator,
    )
    for layer in chain:
        layer.to(device)
    costs, sizes = profile_layers(chain, sample.to(device), steps=pipe.profile_steps)
    for layer in chain:
        layer.to("cpu")
    if pipe.boundaries is None:
        plan = partition_layers(costs, sizes, pipe.num_stages, pipe.transfer)
    else:
        plan = fixed_plan(costs, sizes, pipe.boundaries, pipe.transfer)
    log.info(
        "[site=%s rank=0] pipeline plan: stages=%d replicas=%d schedule=%s microbatches=%d "
        "boundaries=%s stage_times_s=%s predicted_bottleneck_s=%.6f lower_bound_s=%.6f",
        job.site_id,
        pipe.num_stages,
        pipe.num_replicas,
        pipe.schedule,
        pipe.num_microbatches,
        list(plan.boundaries),
        [round(t, 6) for t in plan.stage_times],
        plan.bottleneck,
        plan.lower_bound,
    )
    return plan


def fixed_plan(
    layer_costs_s: Sequence[float],
    activation_bytes: Sequence[int],
    boundaries: Sequence[int],
    transfer: TransferModel | None = None,
) -> PartitionPlan:
    """The plan for given stage starts, timed as ``partition_layers`` times its own."""
    n = len(layer_costs_s)
    link = transfer if transfer is not None else TransferModel()
    starts = list(boundaries)
    if not starts or starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= n:
        raise ValueError(f"boundaries must start at 0, strictly increase and stay below {n}")
    ends = [*starts[1:], n]
    stages = tuple(tuple(range(a, b)) for a, b in zip(starts, ends, strict=True))
    times = tuple(
        sum(layer_costs_s[a:b]) + (link.seconds(activation_bytes[b - 1]) if b < n else 0.0)
        for a, b in zip(starts, ends, strict=True)
    )
    return PartitionPlan(
        boundaries=tuple(starts),
        stages=stages,
        stage_times=times,
        bottleneck=max(times),
        lower_bound=max(max(layer_costs_s), sum(layer_costs_s) / len(starts)),
    )


# -- the leader's trainer and the workers' loop ----------------------------------------------


class PipelineTrainer:
    """The site leader's handle on the whole pipelined site; ``LocalTrainer``'s surface.

    Made with ``PipelineTrainer.start`` on rank 0 while every other rank runs ``worker_loop``.
    Every method is a collective step of the whole site; ``close`` releases the workers.
    """

    def __init__(self, rank_state: _Rank) -> None:
        assert rank_state.rank == 0
        self._rank = rank_state
        self.job = rank_state.job
        self._closed = False
        self._broken = False  # a command failed half-way: the workers' state is unknown

    @classmethod
    def start(
        cls,
        job: PipelineJob,
        corpus: ByteCorpus,
        *,
        device: str | torch.device | None = None,
    ) -> PipelineTrainer:
        """Set up rank 0 together with the workers (profile, partition, broadcast the plan)."""
        if not dist.is_initialized() or dist.get_rank() != 0:
            raise ValueError("PipelineTrainer.start runs on rank 0; other ranks run worker_loop")
        return cls(_setup_rank(job, corpus, None if device is None else torch.device(device)))

    # -- LocalTrainer's surface --------------------------------------------------------------

    @property
    def step(self) -> int:
        """Inner steps taken over the trainer's life; drives the LR schedule."""
        return self._rank.step

    @property
    def plan(self) -> PartitionPlan:
        return self._rank.plan

    @property
    def layout(self) -> PipelineLayout:
        return self._rank.layout

    def train_steps(self, num_steps: int) -> TrainStats:
        """Take ``num_steps`` inner steps on the whole site; the loss is the site's batch mean."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        start = time.perf_counter()
        losses = self._command(("train", num_steps), lambda r: r.train(num_steps))
        compute_seconds = time.perf_counter() - start
        return TrainStats(
            steps=num_steps,
            tokens=num_steps * self.job.optim.batch_size * self.job.model.context_len,
            loss_mean=float(losses.mean()),
            loss_last=float(losses[-1]),
            compute_seconds=compute_seconds,
        )

    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` in eval mode, through replica 0's pipeline."""
        if not batches:
            raise ValueError("evaluate needs at least one batch")
        shapes: list[tuple[int, int]] = []
        for x, y in batches:
            if x.ndim != 2 or tuple(y.shape) != tuple(x.shape):
                raise ValueError(
                    f"each batch must be (x, y) of equal [B, T] shapes, got {tuple(x.shape)} "
                    f"and {tuple(y.shape)}"
                )
            if x.shape[1] > self.job.model.context_len:
                raise ValueError(
                    f"sequence length {x.shape[1]} exceeds model.context_len="
                    f"{self.job.model.context_len}"
                )
            shapes.append((int(x.shape[0]), int(x.shape[1])))
        result = self._command(("evaluate", shapes), lambda r: r.evaluate(shapes, batches))
        assert result is not None
        return float(result)

    def parameters_numpy(self) -> dict[str, np.ndarray]:
        """float32 CPU copies of the whole model's state, named and ordered as
        ``ByteGPT.state_dict()``."""
        params: dict[str, np.ndarray] | None = self._command(
            ("params",), lambda r: r.gather_parameters()
        )
        assert params is not None
        return params

    def load_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Copy ``params`` into every stage of every replica; optimizer state is kept.

        Names and shapes must match the model's ``state_dict`` exactly; nothing is copied otherwise.
        """
        _check_params(params, self._rank.full_spec)
        flats = [
            torch.cat(
                [
                    torch.tensor(np.asarray(params[name]), dtype=torch.float32).reshape(-1)
                    for name in spec.names
                ]
            )
            for spec in self._rank.stage_specs
        ]
        self._command(("load_params",), lambda r: r.scatter_parameters(flats))

    def state_dict(self) -> dict[str, Any]:
        """A CPU snapshot in ``LocalTrainer``'s format, plus ``replica_samplers``."""
        state: dict[str, Any] | None = self._command(("state",), lambda r: r.gather_state())
        assert state is not None
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict`` of this trainer (any stage count) or of a ``LocalTrainer``
        (one replica only)."""
        payloads = self._state_payloads(state)
        self._command(("load_state",), lambda r: r.scatter_state(payloads))

    # -- measurement -------------------------------------------------------------------------

    def last_step_traces(self) -> list[StepTrace]:
        """Per rank (index = rank), the per-op record of the last inner step."""
        traces: list[StepTrace] | None = self._command(("traces",), lambda r: r.gather_traces())
        assert traces is not None and all(t is not None for t in traces)
        return traces

    def measure_transfer_s(self, rounds: int = 20) -> float:
        """Median one-way time of one activation between two adjacent stages (0 for one stage)."""
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        seconds = self._command(("probe", rounds), lambda r: r.probe_transfer(rounds))
        assert seconds is not None
        return float(seconds)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Release the workers (their ``worker_loop`` returns). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._broken:
            _broadcast_command(("stop",), self._rank.control)

    def __enter__(self) -> PipelineTrainer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _command(self, command: tuple[Any, ...], run: Callable[[_Rank], Any]) -> Any:
        if self._closed:
            raise ValueError("the pipeline trainer is closed")
        if self._broken:
            raise RuntimeError("an earlier command failed; the site's ranks are out of step")
        self._broken = True
        _broadcast_command(command, self._rank.control)
        result = run(self._rank)
        self._broken = False
        return result

    def _state_payloads(self, state: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Validate a checkpoint and cut it into one payload per rank (before any command)."""
        r = self._rank
        layout = r.layout
        for key in ("model", "optimizer", "sampler", "step"):
            if key not in state:
                raise ValueError(f"state has no {key!r} entry")
        model = state["model"]
        _check_params(model, r.full_spec)
        optimizer = state["optimizer"]
        groups = optimizer.get("param_groups") if isinstance(optimizer, Mapping) else None
        num_decay = sum(1 for _, shape in r.full_spec if len(shape) >= 2)
        expected = [list(range(num_decay)), list(range(num_decay, len(r.full_optim_names)))]
        if not groups or [list(g["params"]) for g in groups] != expected:
            raise ValueError("optimizer state does not match this model's parameter groups")
        by_name = {r.full_optim_names[int(idx)]: value for idx, value in optimizer["state"].items()}
        hparams = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        samplers = state.get("replica_samplers")
        if samplers is None:
            if layout.num_replicas != 1:
                raise ValueError(
                    f"state holds one sampler but the site has {layout.num_replicas} replicas"
                )
            samplers = [state["sampler"]]
        if len(samplers) != layout.num_replicas:
            raise ValueError(
                f"state holds {len(samplers)} replica samplers, the site has "
                f"{layout.num_replicas} replicas"
            )
        expected_sampler = {
            "batch_size": self.job.optim.batch_size // layout.num_replicas,
            "context_len": self.job.model.context_len,
        }
        for sampler_state in samplers:
            for key, value in expected_sampler.items():
                if sampler_state[key] != value:
                    raise ValueError(
                        f"sampler state has {key}={sampler_state[key]}, this site's replicas "
                        f"sample {key}={value}"
                    )
        step = int(state["step"])
        payloads = []
        for rank in range(layout.world_size):
            stage, replica = layout.stage_of(rank), layout.replica_of(rank)
            spec = r.stage_specs[stage]
            local_decay = sum(
                1 for name, shape in zip(spec.names, spec.shapes, strict=True) if len(shape) >= 2
            )
            local_ranges = [range(local_decay), range(local_decay, len(spec.optim_names))]
            payloads.append(
                {
                    "model": {name: model[name] for name in spec.names},
                    "optimizer": {
                        "state": {
                            idx: by_name[name]
                            for idx, name in enumerate(spec.optim_names)
                            if name in by_name
                        },
                        "param_groups": [
                            {**hp, "params": list(ix)}
                            for hp, ix in zip(hparams, local_ranges, strict=True)
                        ],
                    },
                    "sampler": samplers[replica] if stage in (0, layout.num_stages - 1) else None,
                    "step": step,
                }
            )
        return payloads


def worker_loop(
    job: PipelineJob, corpus: ByteCorpus, *, device: str | torch.device | None = None
) -> None:
    """Run on every rank but 0: set up this rank's stage, then carry out the leader's commands
    until it closes its ``PipelineTrainer``."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        raise ValueError("worker_loop runs on ranks other than 0; rank 0 uses PipelineTrainer")
    r = _setup_rank(job, corpus, None if device is None else torch.device(device))
    while True:
        command = _receive_command(r.control)
        name = command[0]
        if name == "stop":
            return
        if name == "train":
            r.train(command[1])
        elif name == "evaluate":
            r.evaluate(command[1])
        elif name == "params":
            r.gather_parameters()
        elif name == "load_params":
            r.scatter_parameters()
        elif name == "state":
            r.gather_state()
        elif name == "load_state":
            r.scatter_state()
        elif name == "traces":
            r.gather_traces()
        elif name == "probe":
            r.probe_transfer(command[1])
        else:
            raise AssertionError(f"unknown command {name!r}")


def _broadcast_command(command: tuple[Any, ...], control: dist.ProcessGroup) -> None:
    dist.broadcast_object_list([command], src=0, group=control)


def _receive_command(control: dist.ProcessGroup) -> tuple[Any, ...]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    command: tuple[Any, ...] = box[0]
    return command


def _check_params(params: Mapping[str, Any], spec: Sequence[tuple[str, tuple[int, ...]]]) -> None:
    """``LocalTrainer.load_parameters``'s checks: exactly the model's names and shapes."""
    names = [name for name, _ in spec]
    for name in names:
        if name not in params:
            raise ValueError(f"parameter {name!r} is missing")
    known = set(names)
    for name in params:
        if name not in known:
            raise ValueError(f"unexpected parameter {name!r}")
    for name, expected in spec:
        shape = tuple(np.shape(params[name]))
        if shape != tuple(expected):
            raise ValueError(f"parameter {name!r} has shape {shape}, expected {tuple(expected)}")


# -- spawned groups for tests and benchmarks -------------------------------------------------


class LocalProcessGroup:
    """``num_processes`` spawned CPU processes that run functions together in a gloo group.

    ``run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on ranks ``0 .. world_size - 1``,
    each inside a fresh gloo process group (a file store in a private directory: no ports to
    pick), and returns every rank's result. The processes live until ``close``, so torch is
    imported once. A failed or timed-out run marks the group broken; the next ``run`` replaces
    the processes. ``fn`` and its arguments must be picklable (module-level functions).
    """

    def __init__(self, num_processes: int, *, timeout_s: float = 120.0) -> None:
        if num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        self.num_processes = num_processes
        self.timeout_s = timeout_s
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store_dir: str | None = None
        self._runs = 0
        self._broken = False

    def start(self) -> LocalProcessGroup:
        ctx = mp.get_context("spawn")
        self._store_dir = tempfile.mkdtemp(prefix="crossdc-group-")
        self._results = ctx.Queue()
        for rank in range(self.num_processes):
            tasks = ctx.Queue()
            proc = ctx.Process(target=_group_worker, args=(rank, tasks, self._results), daemon=True)
            proc.start()
            self._tasks.append(tasks)
            self._procs.append(proc)
        self._broken = False
        return self

    def run(self, fn: Callable[..., Any], *args: Any, world_size: int | None = None) -> list[Any]:
        world = self.num_processes if world_size is None else world_size
        if not 1 <= world <= self.num_processes:
            raise ValueError(f"world_size must be in 1..{self.num_processes}, got {world}")
        if self._broken:
            self.close()
            self.start()
        assert self._store_dir is not None, "start() first"
        store = os.path.join(self._store_dir, f"store-{self._runs}")
        self._runs += 1
        for rank in range(world):
            self._tasks[rank].put((fn, args, store, world, self.timeout_s))
        results: list[Any] = [None] * world
        pending = set(range(world))
        deadline = time.monotonic() + self.timeout_s
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"ranks {sorted(pending)} did not finish within {self.timeout_s} s"
                    )
                try:
                    rank, ok, value = self._results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r in pending if not self._procs[r].is_alive()]
                    if dead:
                        codes = [self._procs[r].exitcode for r in dead]
                        raise RuntimeError(f"ranks {dead} died (exit codes {codes})") from None
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = value
                pending.discard(rank)
        except BaseException:
            self._broken = True
            raise
        return results

    def close(self) -> None:
        """Stop every process (terminating any that is stuck) and remove the store directory."""
        if not self._broken:
            for tasks in self._tasks:
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=0 if self._broken else 10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.close()
                q.join_thread()
        self._procs, self._tasks, self._results = [], [], None
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def __enter__(self) -> LocalProcessGroup:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _group_worker(rank: int, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args, store, world_size, timeout_s = task
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{store}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            try:
                value = fn(rank, world_size, *args)
            finally:
                dist.destroy_process_group()
            results.put((rank, True, value))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))


# -- launch check ----------------------------------------------------------------------------

LAUNCH_CHECK_MODEL = ModelConfig(context_len=32, num_layers=4, d_model=64, num_heads=4)
LAUNCH_CHECK_MODULES = ("textwrap",)


def launch_check_job(
    *, stages: int, replicas: int, microbatches: int, schedule: str, batch_size: int
) -> PipelineJob:
    """The job ``main`` trains: a small model on one stdlib module, fixed seeds."""
    return PipelineJob(
        model=LAUNCH_CHECK_MODEL,
        optim=InnerOptimConfig(batch_size=batch_size, warmup_steps=0),
        pipeline=PipelineConfig(
            num_stages=stages,
            num_replicas=replicas,
            num_microbatches=microbatches,
            schedule=schedule,
            profile_steps=1,
        ),
        site_id="launch-check",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Launch check: ``torchrun --nproc-per-node S*R -m site_agent.pipeline.runtime --stages S
    --replicas R`` trains a few steps of a small model; rank 0 prints a JSON line."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="site_agent.pipeline.runtime", description=main.__doc__)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    job = launch_check_job(
        stages=args.stages,
        replicas=args.replicas,
        microbatches=args.microbatches,
        schedule=args.schedule,
        batch_size=args.batch_size,
    )
    env = init_from_torchrun_env()
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING)
    torch.set_num_threads(1)
    corpus = ByteCorpus.from_stdlib_modules(LAUNCH_CHECK_MODULES, max_bytes=50_000)
    try:
        if env.rank != 0:
            worker_loop(job, corpus, device=env.device)
            return 0
        with PipelineTrainer.start(job, corpus, device=env.device) as trainer:
            stats = trainer.train_steps(args.steps)
            report = {
                "world_size": env.world_size,
                "backend": env.backend,
                "boundaries": list(trainer.plan.boundaries),
                "steps": trainer.step,
                "loss_mean": stats.loss_mean,
                "loss_last": stats.loss_last,
                "num_parameters": sum(a.size for a in trainer.parameters_numpy().values()),
            }
        print(json.dumps(report), flush=True)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
