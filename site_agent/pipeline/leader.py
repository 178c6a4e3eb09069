"""The leader's handle on a pipelined site: :class:`PipelineTrainer`, the agent's trainer surface
over every rank, held by rank 0 while the others run ``rank.worker_loop`` (docs/pipelines.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from site_agent.jobs.contract import (
    Job,
    JobError,
    StateSpec,
    job_fingerprint,
)
from site_agent.pipeline.engine import PipelineConfig
from site_agent.pipeline.rank import SiteRank, broadcast_command
from site_agent.shardsync import LeaderSync
from site_agent.trainer import TrainStats, check_parameters


class PipelineTrainer:
    """Rank 0's handle on the whole site: the agent's trainer surface (``SiteTrainer``)."""

    evaluates = True  # every job has evaluate

    def __init__(
        self, job: Job, cfg: PipelineConfig, device: torch.device, *, where: str = "the job"
    ) -> None:
        """``job``: built on rank 0 by the job's factory; ``where`` names it in errors."""
        if not dist.is_initialized() or dist.get_rank() != 0:
            raise ValueError("PipelineTrainer runs on rank 0; other ranks run worker_loop")
        self._rank = SiteRank(job, cfg, device, where=where)
        self.where = where
        self._closed = False
        self._broken = False
        self.sharded_sync: LeaderSync | None = None
        """With ``cfg.sync_shards``: the agent syncs through every rank's ``StageSync`` (the
        agent's replica then holds the version, never the values); else it gathers the model."""
        stage_sync = self._rank.stage_sync
        if stage_sync is not None:
            control = self._rank.control
            self.sharded_sync = LeaderSync(
                stage_sync, lambda *call: broadcast_command(("sync", *call), control)
            )

    @property
    def step(self) -> int:
        return self._rank.step

    def train_steps(self, num_steps: int) -> TrainStats:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        start = time.perf_counter()
        losses, weight = self._command("train", num_steps)
        return TrainStats(
            steps=num_steps,
            tokens=weight,
            loss_mean=float(losses.mean()),
            loss_last=float(losses[-1]),
            compute_seconds=time.perf_counter() - start,
        )

    def validate(self) -> dict[str, float]:
        metrics: dict[str, float] = self._command("evaluate_gathered")
        return metrics

    def state_spec(self) -> StateSpec:
        return self._rank.spec

    def buffer_names(self) -> list[str]:
        return list(self._rank.buffers)

    def fingerprint(self, factory_path: str) -> str:
        architecture = getattr(self._rank.job, "architecture", None)
        return job_fingerprint(factory_path, self._rank.spec, architecture)

    def parameters_numpy(self) -> dict[str, np.ndarray]:
        params: dict[str, np.ndarray] = self._command("gather_parameters")
        return params

    def load_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        check_parameters(params, {name: shape for name, shape, _ in self._rank.spec})
        self._command("load_parameters", dict(params))

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self._command("gather_state")
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("model", "step"):
            if key not in state:
                raise ValueError(f"state has no {key!r} entry")
        missing = [n for n in self._rank.order if n not in state["model"]]
        if missing:
            raise JobError(f"the checkpoint lacks {missing[0]!r}")
        self._command("load_state", state)

    def close(self) -> None:
        """Release the workers (their loop returns). Idempotent."""
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

    def _command(self, name: str, *args: Any) -> Any:
        """Broadcast ``(name, *args)`` and run rank 0's part; a failure leaves the trainer broken,
        as the other ranks may be anywhere in it."""
        if self._closed:
            raise ValueError("the pipeline trainer is closed")
        if self._broken:
            raise RuntimeError("an earlier command failed; the site's ranks are out of step")
        self._broken = True
        command = (name, *args)
        broadcast_command(command, self._rank.control)
        result = self._rank.run(command)
        self._broken = False
        return result


__all__ = ["PipelineTrainer"]
