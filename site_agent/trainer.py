"""The inner loop of a site: AdamW steps on the local replica between outer syncs.

``LocalTrainer`` is the single-process trainer. A pipeline trainer offers the same small surface
(``train_steps``, ``evaluate``, ``parameters_numpy``, ``load_parameters``, ``state_dict``,
``load_state_dict``), so the site agent drives either without knowing which one it holds.

As in DiLoCo, the inner optimizer's state survives across rounds: ``load_parameters`` replaces the
model's values with the new global ones but leaves the AdamW moments and the step counter alone.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from site_agent.data import BatchSampler
from site_agent.model import lm_loss


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
    grad_clip: float = 1.0
    """Maximum global gradient L2 norm; 0 disables clipping."""
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
        if not self.grad_clip >= 0:
            raise ValueError(f"inner_optim.grad_clip must be >= 0, got {self.grad_clip}")
        if self.batch_size < 1:
            raise ValueError(f"inner_optim.batch_size must be >= 1, got {self.batch_size}")


@dataclass(frozen=True)
class TrainStats:
    """What one call of ``train_steps`` did."""

    steps: int
    tokens: int
    loss_mean: float
    loss_last: float
    compute_seconds: float


def learning_rate(cfg: InnerOptimConfig, step: int) -> float:
    """The learning rate of inner step ``step`` (0-based): linear warm-up, then constant."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


def _to_cpu(value: Any) -> Any:
    """A snapshot of ``value`` with every tensor copied to the CPU (containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(item) for item in value)
    return value


class LocalTrainer:
    """Inner training of one model replica in this process, on ``device``."""

    def __init__(
        self,
        *,
        model: nn.Module,
        sampler: BatchSampler,
        optim_cfg: InnerOptimConfig,
        device: str | torch.device = "cpu",
    ) -> None:
        if sampler.batch_size != optim_cfg.batch_size:
            raise ValueError(
                f"sampler batch_size={sampler.batch_size} differs from "
                f"inner_optim.batch_size={optim_cfg.batch_size}"
            )
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.sampler = sampler
        self.optim_cfg = optim_cfg
        self.step = 0  # inner steps taken over the trainer's whole life, drives the LR schedule
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": optim_cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=learning_rate(optim_cfg, 0),
            betas=(optim_cfg.beta1, optim_cfg.beta2),
        )

    def train_steps(self, num_steps: int) -> TrainStats:
        """Take ``num_steps`` inner AdamW steps on freshly sampled batches."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.model.train()
        cfg = self.optim_cfg
        losses: list[torch.Tensor] = []
        tokens = 0
        start = time.perf_counter()
        for _ in range(num_steps):
            x, y = self.sampler.next_batch()
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            loss = lm_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            if cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            lr = learning_rate(cfg, self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.step += 1
            tokens += y.numel()
            losses.append(loss.detach())
        # One host sync for the whole call: reading the losses waits for the device to finish.
        loss_values = torch.stack(losses).double().cpu()
        compute_seconds = time.perf_counter() - start
        return TrainStats(
            steps=num_steps,
            tokens=tokens,
            loss_mean=float(loss_values.mean()),
            loss_last=float(loss_values[-1]),
            compute_seconds=compute_seconds,
        )

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` in eval mode; equal-sized batches make it a per-token mean."""
        if not batches:
            raise ValueError("evaluate needs at least one batch")
        was_training = self.model.training
        self.model.eval()
        try:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for x, y in batches:
                logits = self.model(x.to(self.device))
                total += lm_loss(logits, y.to(self.device)).double()
        finally:
            self.model.train(was_training)
        return float(total.cpu()) / len(batches)

    def parameters_numpy(self) -> dict[str, np.ndarray]:
        """float32 CPU copies of the model's state, in ``state_dict`` order."""
        return {
            name: tensor.detach().to("cpu", torch.float32, copy=True).numpy()
            for name, tensor in self.model.state_dict().items()
        }

    def load_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Copy ``params`` into the model in place; the optimizer state is kept.

        Names and shapes must match the model's ``state_dict`` exactly; nothing is copied otherwise.
        """
        state = self.model.state_dict()
        for name in state:
            if name not in params:
                raise ValueError(f"parameter {name!r} is missing")
        for name in params:
            if name not in state:
                raise ValueError(f"unexpected parameter {name!r}")
        for name, tensor in state.items():
            shape = tuple(np.shape(params[name]))
            if shape != tuple(tensor.shape):
                raise ValueError(
                    f"parameter {name!r} has shape {shape}, expected {tuple(tensor.shape)}"
                )
        with torch.no_grad():
            for name, tensor in state.items():
                # torch.tensor copies, so read-only arrays (e.g. decoded from the wire) are fine.
                tensor.copy_(torch.tensor(params[name]))

    def state_dict(self) -> dict[str, Any]:
        """A CPU snapshot of model, optimizer, sampler and step; safe for ``weights_only`` loads."""
        return {
            "model": _to_cpu(self.model.state_dict()),
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "sampler": self.sampler.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
