"""One rank's share of a pipelined site and its part in each of the leader's commands.

This module owns ``Rank``: what one rank holds (its stage's module and executor, its replica's
sampler where it is a first or last stage, the control group, every stage's parameter spec) and
what it does for each command, called on all ranks together (the leader included): train steps,
evaluate through replica 0's pipeline, gather and scatter parameters (the outer sync), gather and
scatter checkpoint state (``checkpoint`` translates the format), gather step traces and probe the
time of one transfer between stages.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from site_agent.data import BatchSampler
from site_agent.pipeline.checkpoint import merge_state
from site_agent.pipeline.executor import StageExecutor, StepTrace
from site_agent.pipeline.job import PipelineJob
from site_agent.pipeline.partition import PartitionPlan
from site_agent.pipeline.stage import StageSpec, flatten, unflatten
from site_agent.trainer import _to_cpu

_TAG_TARGETS = 7  # evaluation targets from the leader to the last stage


class Rank:
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
        stage_specs: list[StageSpec],
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
        return merge_state(
            gathered,
            layout=self.layout,
            full_spec=self.full_spec,
            full_optim_names=self.full_optim_names,
            step=self.step,
        )

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
