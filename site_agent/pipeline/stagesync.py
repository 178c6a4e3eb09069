"""A pipelined site's sync, rank by rank: each rank syncs the tensors its stages hold.

A pipeline rank holds its stages' tensors only: whole, or under ``data_parallel = "fsdp"`` its
row shard of each (a DTensor on the stage's data-parallel group). :class:`StageSync` is the
sharded site's :class:`~site_agent.shardsync.RankSync` on such a rank, over a group of the
site's own (``SiteRank.sync_group``, whose collectives time out after ``rank_timeout_s``):
the rank keeps θ and the error-feedback residual of its own rows, encodes its update where they
live, decodes only its rows of a result, and the state hash of the whole model is combined
on the leader from every rank's block digests and the model's spec (``shards.shard_hash``). The
leader (``leader.PipelineTrainer.sharded_sync``) relays encoded bytes; it keeps no tensor of
another stage. A stage's tensor held whole by every replica is sent and hashed by the first
replica's rank; an FSDP shard by each rank holding rows of it.

Validation still gathers θ to the leader's copy of the model (``job.evaluate`` takes a whole
model); a checkpoint is ``torch.distributed.checkpoint``: θ and the residuals by tensor (each
rank writes its rows, another layout reshards them), and each rank's optimizer, scheduler, step
and job state as its own entry.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from site_agent.jobs.contract import StateSpec
from site_agent.pipeline.engine import RankPipeline
from site_agent.pipeline.layout import PipelineLayout
from site_agent.shards import RankShards
from site_agent.shardsync import RankSync


class StageSite(Protocol):
    """What a :class:`StageSync` uses of its rank (``rank.SiteRank``)."""

    pipeline: RankPipeline
    rank: int
    layout: PipelineLayout
    spec: StateSpec
    sync_group: Any
    control: Any

    def evaluate_gathered(self) -> dict[str, float] | None: ...

    def training_state(self) -> dict[str, Any]: ...

    def load_training_state(
        self, own: Mapping[str, Any] | None, *, leader: Mapping[str, Any] | None
    ) -> None: ...


class StageSync(RankSync):
    """One pipeline rank's :class:`RankSync` (module docstring). Built by every rank of the site
    (no communication); each call is collective over the site's sync group (its
    collectives time out after ``PipelineConfig.rank_timeout_s``)."""

    def __init__(self, site: StageSite, *, decay: float = 1.0) -> None:
        pipeline = site.pipeline
        state = pipeline.state()  # this rank's tensors, by the whole model's names
        shards = RankShards(
            state.items(),
            rank=site.rank,
            decay=decay,
            owns_whole=site.layout.replica_of(site.rank) == 0,
            shapes={name: shape for name, shape, _ in site.spec},
        )
        super().__init__(
            nn.ModuleList(pipeline.modules),
            group=site.sync_group,
            decay=decay,
            evaluate=lambda _model: _evaluated(site),
            optimizer=pipeline.optimizer,
            shards=shards,
        )
        self.state = state
        self._site = site

    def holds(self) -> list[str]:
        """The federated tensors this rank keeps θ of (its stages'), in the model's order."""
        return [name for name in self.shards.shapes if name in self.shards.ranges]

    # ---- checkpoint ------------------------------------------------------------------------

    def _own_key(self) -> str:
        return f"pipeline/rank{self.rank}"

    def _checkpoint_state(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self._site.training_state(), buffer)
        blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        return {"shards": self.shards.state_dict(), self._own_key(): blob}

    def _load_target(self, path: str) -> dict[str, Any]:
        """θ and the residuals of this rank's rows (written under this layout or another), and
        this rank's training state where one was written for its rank under the same layout
        (else the leader's step and job state only)."""
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        stored = FileSystemReader(path).read_metadata().state_dict_metadata
        state: dict[str, Any] = {"shards": self.shards.state_dict()}
        for key in dict.fromkeys([self._own_key(), "pipeline/rank0"]):
            meta = stored.get(key)
            size = getattr(meta, "size", None)
            if size is not None:
                state[key] = torch.empty(tuple(size), dtype=torch.uint8)
        return state

    def _take_loaded(self, state: dict[str, Any]) -> None:
        """What :meth:`_load_target` read taken; then the local rows ← θ."""
        self.shards.load_state_dict(state["shards"])
        keys = dict.fromkeys([self._own_key(), "pipeline/rank0"])
        trained = {key: _unpack(state[key]) for key in keys if key in state}
        self._site.load_training_state(
            trained.get(self._own_key()), leader=trained.get("pipeline/rank0")
        )
        self._reset_here()


def _evaluated(site: StageSite) -> dict[str, float]:
    """The job's metrics of the model as the ranks hold it (on the leader; empty elsewhere).
    The workers wait for the leader's evaluation on the control group, whose wait has no
    bound to speak of: an evaluation may take longer than ``rank_timeout_s``."""
    metrics = site.evaluate_gathered()
    dist.barrier(group=site.control)
    return metrics or {}


def _unpack(blob: torch.Tensor) -> Mapping[str, Any]:
    value = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=False)
    assert isinstance(value, Mapping)
    return value


__all__ = ["StageSync"]
