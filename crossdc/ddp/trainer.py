"""A ``LocalTrainer`` driven one gradient at a time, as a baseline site trains.

This module owns ``DDPTrainer``: it computes the gradient of a batch without stepping
(``compute_gradient``) and takes the AdamW step on a given gradient (``apply_gradient``: the same
clipping and learning-rate schedule as :class:`~crossdc.bench.local_trainer.LocalTrainer`,
which it wraps), so the sites of a run, applying the same mean gradients, stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from crossdc.bench.local_trainer import LocalTrainer
from site_agent.jobs.bytegpt.model import lm_loss
from site_agent.jobs.bytegpt.optim import learning_rate

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepGradient:
    """The gradient of one batch at the current parameters, and what it was computed on."""

    grads: dict[str, np.ndarray]
    """float32 CPU arrays by parameter name (``state_dict`` names)."""
    tokens: int
    loss: float


class DDPTrainer:
    """A :class:`LocalTrainer` driven one gradient at a time: compute, then apply a given one.

    It uses the wrapped trainer's model, sampler, AdamW, clipping and step counter, so a
    gradient applied here is stepped exactly as ``LocalTrainer.train_steps`` would step its own.
    """

    def __init__(self, local: LocalTrainer) -> None:
        self.local = local
        names = [name for name, _ in local.model.named_parameters()]
        if names != list(local.model.state_dict()):
            raise ValueError("the model's state must consist of its parameters only")
        self._params: dict[str, nn.Parameter] = dict(local.model.named_parameters())

    @property
    def step(self) -> int:
        """Optimizer steps taken (drives the learning-rate schedule)."""
        return self.local.step

    def compute_gradient(self, batch: Batch | None = None) -> StepGradient:
        """Forward and backward on ``batch`` (the sampler's next one by default); no step."""
        x, y = self.local.sampler.next_batch() if batch is None else batch
        model = self.local.model
        model.train()
        device = self.local.device
        loss = lm_loss(model(x.to(device)), y.to(device))
        self.local.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        grads: dict[str, np.ndarray] = {}
        for name, p in self._params.items():
            g = torch.zeros_like(p) if p.grad is None else p.grad
            grads[name] = g.detach().to("cpu", torch.float32, copy=True).numpy()
        self.local.optimizer.zero_grad(set_to_none=True)
        return StepGradient(grads=grads, tokens=int(y.numel()), loss=float(loss.detach()))

    def apply_gradient(self, grad: Mapping[str, np.ndarray]) -> None:
        """Set every parameter's ``.grad`` to ``grad``, clip, and take one AdamW step.

        Names and shapes must match the parameters exactly; nothing changes otherwise.
        """
        if set(grad) != set(self._params):
            missing = sorted(set(self._params) - set(grad))[:3]
            extra = sorted(set(grad) - set(self._params))[:3]
            raise ValueError(f"gradient names differ: missing {missing} extra {extra}")
        for name, p in self._params.items():
            if tuple(np.shape(grad[name])) != tuple(p.shape):
                raise ValueError(
                    f"gradient {name!r} has shape {np.shape(grad[name])}, expected {tuple(p.shape)}"
                )
        cfg = self.local.optim_cfg
        for name, p in self._params.items():
            # torch.tensor copies: the caller's arrays (maybe read-only) are never touched.
            p.grad = torch.tensor(grad[name], dtype=p.dtype, device=p.device)
        if self.local.grad_clip > 0:
            nn.utils.clip_grad_norm_(self._params.values(), self.local.grad_clip)
        lr = learning_rate(cfg, self.local.step)
        for group in self.local.optimizer.param_groups:
            group["lr"] = lr
        self.local.optimizer.step()
        self.local.optimizer.zero_grad(set_to_none=True)
        self.local.step += 1

    def evaluate(self, batches: Sequence[Batch]) -> float:
        return self.local.evaluate(batches)

    def parameters_numpy(self) -> dict[str, np.ndarray]:
        return self.local.parameters_numpy()
