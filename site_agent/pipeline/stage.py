"""What a pipeline stage is: the rank layout, a stage's slice of the model, and its parameters.

This module owns the pieces every rank of a pipelined site agrees on before any step runs:

- ``PipelineLayout``: which rank is which (stage, replica). Rank ``replica * num_stages + stage``,
  so the ranks of one replica's pipeline are contiguous and rank 0 is stage 0 of replica 0.
- ``StageModule``: a contiguous slice of a layer chain (``ByteGPT.layers``) that keeps the
  full-model parameter names (``layers.3.qkv.weight``), so a stage's ``state_dict`` is a slice of
  the single-process one.
- ``StageSpec``: names, shapes and optimizer order of one stage's parameters, known on every
  rank for every stage.
- the optimizer's view of a stage (``adamw_param_names``, ``build_adamw``: the same two parameter
  groups as ``LocalTrainer``) and flat float32 vectors of its tensors (``flatten``,
  ``unflatten``), as they travel between ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from site_agent.jobs.bytegpt import adamw
from site_agent.trainer import InnerOptimConfig


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """``num_stages`` x ``num_replicas`` ranks: rank = ``replica * num_stages + stage``."""

    num_stages: int
    """Pipeline stages per replica."""
    num_replicas: int
    """Data-parallel copies of the whole pipeline."""

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas

    def rank(self, *, stage: int, replica: int) -> int:
        assert 0 <= stage < self.num_stages and 0 <= replica < self.num_replicas
        return replica * self.num_stages + stage

    def stage_of(self, rank: int) -> int:
        return rank % self.num_stages

    def replica_of(self, rank: int) -> int:
        return rank // self.num_stages

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` in every replica: one data-parallel group."""
        return [self.rank(stage=stage, replica=r) for r in range(self.num_replicas)]

    def replica_ranks(self, replica: int) -> list[int]:
        """The ranks of one replica's pipeline, stage order."""
        return [self.rank(stage=s, replica=replica) for s in range(self.num_stages)]


class StageModule(nn.Module):
    """Layers ``indices`` of a chain, applied in order, named as in the full model.

    The layers live in a ``ModuleDict`` called ``layers`` keyed by their index in the full chain,
    so parameter names are ``layers.<index>.<...>``: exactly the names ``ByteGPT.state_dict()``
    uses for them.
    """

    def __init__(self, layers: Mapping[int, nn.Module]) -> None:
        super().__init__()
        indices = sorted(layers)
        if not indices:
            raise ValueError("a stage needs at least one layer")
        if indices != list(range(indices[0], indices[-1] + 1)):
            raise ValueError(f"stage layers must be contiguous, got {indices}")
        self.layer_indices = tuple(indices)
        self.layers = nn.ModuleDict({str(i): layers[i] for i in indices})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.layer_indices:
            x = self.layers[str(i)](x)
        return x


@dataclass(frozen=True)
class StageSpec:
    """Names, shapes and optimizer order of one stage's parameters (known on every rank)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    optim_names: tuple[str, ...]

    @property
    def numel(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)

    @classmethod
    def of(cls, module: nn.Module) -> StageSpec:
        named = list(module.state_dict().items())
        return cls(
            names=tuple(n for n, _ in named),
            shapes=tuple(tuple(t.shape) for _, t in named),
            optim_names=tuple(adamw_param_names(module)),
        )


def slice_stage(chain: Sequence[nn.Module], layer_indices: Sequence[int]) -> StageModule:
    """The stage made of ``chain[i]`` for ``i`` in ``layer_indices`` (the modules are shared)."""
    return StageModule({i: chain[i] for i in layer_indices})


def adamw_param_names(module: nn.Module) -> list[str]:
    """Parameter names in the optimizer's index order: weight-decayed (ndim >= 2) first, then the
    rest, each in module order. ``LocalTrainer`` and ``build_adamw`` group parameters this way."""
    named = list(module.named_parameters())
    return [n for n, p in named if p.ndim >= 2] + [n for n, p in named if p.ndim < 2]


def build_adamw(module: nn.Module, cfg: InnerOptimConfig) -> torch.optim.AdamW:
    """AdamW with the same two parameter groups and hyper-parameters as ``LocalTrainer``."""
    return adamw(module, cfg)


def split_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Views of consecutive pieces of ``flat``, each shaped like the next of ``like``."""
    offset = 0
    for t in like:
        n = t.numel()
        yield flat[offset : offset + n].view_as(t)
        offset += n


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous float32 vector of ``tensors``, in order."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like``, in order; ``flat`` must hold exactly their elements."""
    assert flat.numel() == sum(t.numel() for t in like)
    return list(split_like(flat, like))
