"""The byte GPT job's inner optimizer: AdamW with decoupled weight decay and a linear warm-up.

``InnerOptimConfig`` is the ``optim`` table of the job's options (``[site.job.options.optim]``);
``adamw`` builds the optimizer and ``WarmupSchedule`` steps its learning rate along
``learning_rate``. Gradient clipping is not here: crossdc clips every job's gradients
(``site.job.grad_clip``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler


@dataclass(frozen=True, kw_only=True)
class InnerOptimConfig:
    """The site-local AdamW and its schedule."""

    lr: float = 3e-3
    """Peak learning rate, reached after warm-up and then held constant."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to weight matrices and embeddings only."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    warmup_steps: int = 20
    """Inner steps of linear warm-up from ``lr / warmup_steps`` to ``lr``; 0 disables it."""
    batch_size: int = 16
    """Sequences per inner step."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"inner_optim.lr must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"inner_optim.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"inner_optim.{name} must be in [0, 1), got {value}")
        if self.warmup_steps < 0:
            raise ValueError(f"inner_optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.batch_size < 1:
            raise ValueError(f"inner_optim.batch_size must be >= 1, got {self.batch_size}")


def learning_rate(cfg: InnerOptimConfig, step: int) -> float:
    """The learning rate of inner step ``step`` (0-based): linear warm-up, then constant."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


class WarmupSchedule(LRScheduler):
    """``learning_rate(cfg, step)`` for the step about to be taken: linear warm-up, then flat."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: InnerOptimConfig) -> None:
        self._cfg = cfg
        super().__init__(optimizer)

    def get_lr(self) -> list[float | torch.Tensor]:
        return [learning_rate(self._cfg, self.last_epoch) for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        # Numbers only (the config is rebuilt from the site's), so weights_only loads take it.
        return {k: v for k, v in super().state_dict().items() if k != "_cfg"}


def adamw(model: nn.Module, cfg: InnerOptimConfig) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on weight matrices and embeddings only."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=learning_rate(cfg, 0),
        betas=(cfg.beta1, cfg.beta2),
    )
