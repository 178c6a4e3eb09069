"""Setting up a pipelined site's ranks: every rank's model slice, executor and sampler.

This module owns the collective setup (``PipelineTrainer.start`` on rank 0 and ``worker_loop``
elsewhere): every rank builds the full model from ``(model config, model_seed)`` on the CPU, so
initial weights agree without a transfer; the leader profiles the real layers on a sample
micro-batch (``profile_layers``), cuts the chain with ``partition_layers`` (or applies fixed
boundaries, ``fixed_plan``) and broadcasts the plan; each rank keeps its stage's layers and drops
the rest, then joins its stage's data-parallel group and its replica's pipeline group.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from site_agent.data import BatchSampler, ByteCorpus
from site_agent.model import build_model, param_spec
from site_agent.pipeline.executor import StageExecutor
from site_agent.pipeline.job import PipelineJob, replica_seed
from site_agent.pipeline.partition import (
    PartitionPlan,
    TransferModel,
    partition_layers,
    profile_layers,
)
from site_agent.pipeline.procgroup import default_device
from site_agent.pipeline.rank import Rank
from site_agent.pipeline.schedule import make_schedule
from site_agent.pipeline.stage import (
    PipelineLayout,
    StageModule,
    StageSpec,
    adamw_param_names,
    slice_stage,
)

log = logging.getLogger(__name__)

# Workers wait for the leader's next command for as long as the leader spends between calls
# (an outer sync over the WAN can take many minutes), so the control group never times out first.
CONTROL_TIMEOUT = timedelta(days=7)


def setup_rank(job: PipelineJob, corpus: ByteCorpus, device: torch.device | None) -> Rank:
    """Collective: every rank of the site calls it with the same ``job``."""
    rank = _check_world(job.layout)
    device = torch.device(device) if device is not None else default_device()
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    assert control is not None

    model = build_model(job.model, seed=job.model_seed)
    chain = list(model.layers)
    full_spec = param_spec(model)
    full_optim_names = adamw_param_names(model)
    box: list[Any] = [None]
    if rank == 0:
        box[0] = make_plan(job, chain, device)
    dist.broadcast_object_list(box, src=0, group=control)
    plan: PartitionPlan = box[0]

    layout = job.layout
    stage, replica = layout.stage_of(rank), layout.replica_of(rank)
    stage_specs = [StageSpec.of(slice_stage(chain, layers)) for layers in plan.stages]
    assert [n for spec in stage_specs for n in spec.names] == [n for n, _ in full_spec]
    module = slice_stage(chain, plan.stages[stage]).to(device)
    del model, chain

    executor = _make_executor(job, module, stage=stage, replica=replica, device=device)
    sampler = None
    if stage in (0, layout.num_stages - 1):
        sampler = BatchSampler(
            corpus,
            batch_size=job.optim.batch_size // layout.num_replicas,
            context_len=job.model.context_len,
            seed=replica_seed(job.data_seed, replica, layout.num_replicas),
        )
    dist.barrier(group=control)
    return Rank(
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


def _check_world(layout: PipelineLayout) -> int:
    """This process's rank, once the process group is known to match ``layout``."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: call init_from_torchrun_env()")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != layout.world_size:
        raise ValueError(
            f"the process group has {world_size} ranks but pipeline.num_stages x "
            f"pipeline.num_replicas = {layout.num_stages} x {layout.num_replicas} = "
            f"{layout.world_size}"
        )
    return rank


def _make_executor(
    job: PipelineJob, module: StageModule, *, stage: int, replica: int, device: torch.device
) -> StageExecutor:
    """This rank's executor, after joining every data-parallel and pipeline group."""
    layout = job.layout
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
    return StageExecutor(
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


def make_plan(
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
