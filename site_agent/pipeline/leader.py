"""The site leader's handle on a pipelined site: ``LocalTrainer``'s surface over every rank.

This module owns ``PipelineTrainer``, which rank 0 holds. It offers the same surface as
``LocalTrainer`` (``train_steps``, ``evaluate``, ``parameters_numpy``, ``load_parameters``,
``state_dict``, ``load_state_dict``, ``step``), so the site agent drives either without knowing
which. Each call validates its arguments, broadcasts a command (``worker``) and carries out rank
0's part of it (``Rank``) while every other rank carries out its own.

Outer sync: ``parameters_numpy`` gathers every stage's parameters (from replica 0; replicas are
equal after every step) into one dict with the single-process ``ByteGPT.state_dict()`` names and
order; ``load_parameters`` sends every rank of every replica its stage's slice. ``state_dict``
has ``LocalTrainer``'s format plus every replica's sampler (``checkpoint``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from site_agent.data import ByteCorpus
from site_agent.pipeline.checkpoint import check_params, split_state
from site_agent.pipeline.executor import StepTrace
from site_agent.pipeline.job import PipelineJob
from site_agent.pipeline.partition import PartitionPlan
from site_agent.pipeline.rank import Rank
from site_agent.pipeline.setup import setup_rank
from site_agent.pipeline.stage import PipelineLayout
from site_agent.pipeline.worker import broadcast_command
from site_agent.trainer import TrainStats


class PipelineTrainer:
    """The site leader's handle on the whole pipelined site; ``LocalTrainer``'s surface.

    Made with ``PipelineTrainer.start`` on rank 0 while every other rank runs ``worker_loop``.
    Every method is a collective step of the whole site; ``close`` releases the workers.
    """

    def __init__(self, rank_state: Rank) -> None:
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
        return cls(setup_rank(job, corpus, None if device is None else torch.device(device)))

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
        check_params(params, self._rank.full_spec)
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
            broadcast_command(("stop",), self._rank.control)

    def __enter__(self) -> PipelineTrainer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _command(self, command: tuple[Any, ...], run: Callable[[Rank], Any]) -> Any:
        if self._closed:
            raise ValueError("the pipeline trainer is closed")
        if self._broken:
            raise RuntimeError("an earlier command failed; the site's ranks are out of step")
        self._broken = True
        broadcast_command(command, self._rank.control)
        result = run(self._rank)
        self._broken = False
        return result

    def _state_payloads(self, state: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Validate a checkpoint and cut it into one payload per rank (before any command)."""
        r = self._rank
        return split_state(
            state,
            layout=r.layout,
            full_spec=r.full_spec,
            full_optim_names=r.full_optim_names,
            stage_specs=r.stage_specs,
            expected_sampler={
                "batch_size": self.job.optim.batch_size // r.layout.num_replicas,
                "context_len": self.job.model.context_len,
            },
        )
